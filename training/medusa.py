"""Training Medusa heads (engine/spec_decode/medusa.py): their losses, held-out acceptance and
the (head, rank) accuracies their sparse tree is chosen from. The data, the budget,
checkpoints, resume and the report are the EAGLE head's (training/speculator.py): one
pipeline, two kinds of heads.

Head j reads the target's last-layer output at position p and learns the target's
distribution of the token at p + 2 + j (recorded at position p + 1 + j as soft labels over
the draft vocabulary); head j's loss weighs DECAY ** j (Medusa-1's decay).
"""

from __future__ import annotations

import torch

from engine.spec_decode.medusa import TREE_TOP_K, MedusaHeads

DECAY = 0.8


def _logits(heads: MedusaHeads, ex) -> torch.Tensor:
    """[T - 1, K, draft vocab]: every head's scores at each position with a feature."""
    device = next(heads.parameters()).device
    features = ex.features[:len(ex.ids) - 1].to(device=device, dtype=heads.lm_head.weight.dtype)
    return heads(features)


def losses(heads: MedusaHeads, ex, labels) -> tuple[torch.Tensor, list[float]]:
    """The example's loss and each head's top-1 accuracy on its trained rows."""
    logits = _logits(heads, ex)
    device = logits.device
    total, weight, accuracy = torch.zeros((), device=device), 0.0, []
    n = len(ex.ids)
    for j in range(heads.config.num_heads):
        rows = n - 2 - j  # rows p = 0 .. n - 3 - j: their label sits at p + 1 + j <= n - 2
        if rows <= 0:
            break
        pos = torch.arange(1 + j, 1 + j + rows)
        target, ok = labels.soft(ex, pos, logits.shape[-1])
        ok &= ex.mask[pos]
        if not ok.any():
            continue
        head_logits = logits[:rows, j].float()
        ok_d = ok.to(device)
        ce = -(target.to(device) * torch.log_softmax(head_logits, dim=-1)).sum(1)
        total = total + DECAY ** j * ce[ok_d].mean()
        weight += DECAY ** j
        top = labels.row[ex.top_ids[pos, 0].long()].to(device)
        accuracy.append(float((head_logits.argmax(1) == top)[ok_d].float().mean()))
    return total / max(weight, 1e-9), accuracy


@torch.no_grad()
def acceptance_lengths(heads: MedusaHeads, examples: list, labels, k: int) -> list[float]:
    """Per k' = 1..k: the mean tokens one verification of the heads' k' greedy drafts (a
    chain of each head's best token) emits, over answer positions where greedy decoding would
    have emitted the recorded tokens (as training/speculator.py measures an EAGLE head)."""
    k = min(k, heads.config.num_heads)
    sums, counts = [0.0] * k, [0] * k
    for ex in examples:
        n = len(ex.ids)
        rows = n - 1 - k  # rows whose k drafts all have labels (p + k <= n - 2)
        if rows <= 0:
            continue
        best = _logits(heads, ex)[:rows, :k].argmax(-1).cpu()  # [rows, k] draft rows
        run = torch.ones(rows, dtype=torch.bool)
        valid = torch.ones(rows, dtype=torch.bool)
        accepted = torch.zeros(rows)
        for j in range(k):
            pos = torch.arange(1 + j, 1 + j + rows)
            top = ex.top_ids[pos, 0].long()
            run &= (best[:, j] == labels.row[top]) & (labels.row[top] >= 0)
            valid &= ex.mask[pos]
            accepted += run.float()
            sums[j] += float(accepted[valid].sum())
            counts[j] += int(valid.sum())
            run &= ex.ids[pos + 1] == top  # the next draft is judged on greedy's token
    return [1.0 + s / max(c, 1) for s, c in zip(sums, counts)]


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, examples: list, labels) -> list[list[float]]:
    """[head][rank]: on held-out answer positions, how often head j's rank-r token is the
    target's top token (what the sparse tree is chosen from)."""
    K = heads.config.num_heads
    hits = torch.zeros(K, TREE_TOP_K)
    counts = torch.zeros(K)
    for ex in examples:
        logits = _logits(heads, ex)
        n = len(ex.ids)
        for j in range(K):
            rows = n - 2 - j
            if rows <= 0:
                break
            pos = torch.arange(1 + j, 1 + j + rows)
            ok = ex.mask[pos]
            top = labels.row[ex.top_ids[pos, 0].long()]
            ranked = logits[:rows, j].topk(TREE_TOP_K, dim=-1).indices.cpu()
            hits[j] += (ranked == top[:, None])[ok].float().sum(0)
            counts[j] += float(ok.sum())
    return (hits / counts.clamp(min=1)[:, None]).tolist()
