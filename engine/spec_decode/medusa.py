"""Medusa-1 draft heads: K small heads on the target's last hidden state, head j guessing the
token j + 2 after it (the target's own logits give the next one).

Must not schedule, verify or run the target: it is a module, its file format, its sparse tree
and its checks (the proposer is medusa_proposer.py, the training training/speculator.py).

The heads read the output of the target's last decoder layer at the last committed token's
position minus one (the row whose logits gave the last token): `norm` (the target's final norm,
copied) turns it into x; head j is one residual SiLU block, y_j = x + SiLU(W_j x + b_j) (zero
at the start: y_j = x), and one output projection over the draft vocabulary (`vocab`, the
target ids of its rows) scores all K heads' y_j: the projection's weights are read once per
step for every head (on a memory-bound CPU one read, not K). It starts as the target's own
output rows.

The tree (Medusa's sparse tree): the candidates are paths of top-k ranks, (r_1, ..., r_d)
taking head 1's r_1-th best token, then head 2's r_2-th, ...; each path's chance is the product
of the held-out accuracy of each (head, rank) (the chance that this rank of that head is the
target's token), and the tree keeps the most likely paths, a parent before its children
(`choose_tree`). Training measures the accuracies and stores them with the tree; a server
prunes it to `tree_max_nodes` (its first nodes are a tree too).

The file: a folder with `config.json` (MedusaConfig, format FORMAT) and `model.safetensors`,
checked at start-up like an EAGLE head (eagle.py: another target, a corrupt file, the wrong
kind: an error naming `speculative.speculator`), saved by eagle.save_head.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.spec_decode.eagle import (HeadFileError, check_same_target, copy_output_rows,
                                      fingerprint, load_weights, target_shape)

FORMAT = "specserve-medusa-heads-1"
MAX_TREE_NODES = 64  # the tree stored with the heads (tree_max_nodes is at most 64)
TREE_TOP_K = 8  # ranks of each head a tree may take


@dataclass
class MedusaConfig:
    target: str  # the target's name as served, for messages
    target_shape: dict
    hidden_size: int
    num_heads: int  # K: head j (0-based) guesses the token j + 2 after its row
    rms_norm_eps: float
    layers: list[int]  # [the target's last layer]: what the runner captures
    vocab: list[int] = field(default_factory=list)
    fingerprint: list[list[float]] = field(default_factory=list)
    # [head][rank]: measured chance that head j's rank-r token is the target's (held-out)
    accuracy: list[list[float]] = field(default_factory=list)
    tree: list[list[int]] = field(default_factory=list)  # paths of ranks, parents first
    format: str = FORMAT
    trained: dict = field(default_factory=dict)


def medusa_config(model: nn.Module, name: str, vocab: list[int], num_heads: int
                  ) -> MedusaConfig:
    cfg = model.config.get_text_config()
    return MedusaConfig(target=name, target_shape=target_shape(model),
                        hidden_size=cfg.hidden_size, num_heads=num_heads,
                        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
                        layers=[cfg.num_hidden_layers - 1], vocab=list(vocab),
                        fingerprint=fingerprint(model))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = c = config
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.blocks = nn.ModuleList(nn.Linear(c.hidden_size, c.hidden_size, bias=True)
                                    for _ in range(c.num_heads))
        self.lm_head = nn.Linear(c.hidden_size, len(c.vocab), bias=False)
        self.register_buffer("vocab", torch.tensor(c.vocab, dtype=torch.long), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, K, draft vocab] scores of each head from the target's last-layer outputs
        [T, H]."""
        x = self.norm(hidden)
        y = torch.stack([x + F.silu(block(x)) for block in self.blocks], dim=1)
        return self.lm_head(y)


def initialize_from_target(heads: MedusaHeads, model: nn.Module) -> None:
    """The blocks zero (every head starts as the target's own next-token guess), the norm and
    the output projection the target's."""
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.zero_()
            block.bias.zero_()
        heads.norm.weight.copy_(model.model.norm.weight.float())
    copy_output_rows(heads.lm_head, model, heads.vocab)


# -- the sparse tree ----------------------------------------------------------------------------
def default_accuracy(num_heads: int) -> list[list[float]]:
    """What an untrained or unmeasured set of heads is assumed to reach: head j's best token
    right 0.5 ** (j + 1) of the time, its rank r one (r + 1) times less."""
    return [[0.5 ** (j + 1) / (r + 1) for r in range(TREE_TOP_K)] for j in range(num_heads)]


def choose_tree(accuracy: list[list[float]], max_nodes: int = MAX_TREE_NODES
                ) -> list[list[int]]:
    """The `max_nodes` paths of ranks with the highest chance (the product of their (head,
    rank) accuracies), best first; a path's prefix comes before it (its chance is no less)."""
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0])) if accuracy[0][r] > 0]
    heapq.heapify(heap)
    tree: list[list[int]] = []
    while heap and len(tree) < max_nodes:
        neg, path = heapq.heappop(heap)
        tree.append(list(path))
        depth = len(path)
        if depth < len(accuracy):
            for r, a in enumerate(accuracy[depth]):
                if a > 0:
                    heapq.heappush(heap, (neg * a, path + (r,)))
    return tree


def path_chance(accuracy: list[list[float]], path: list[int]) -> float:
    return math.prod(accuracy[j][r] for j, r in enumerate(path))


# -- files --------------------------------------------------------------------------------------
def config_from(data: dict, where: str, option: str) -> MedusaConfig:
    try:
        config = MedusaConfig(**data)
    except TypeError as exc:
        raise HeadFileError(f"invalid {option}: {where} is not a Medusa config ({exc})"
                            ) from None
    if not isinstance(config.num_heads, int) or not 1 <= config.num_heads <= 16:
        raise HeadFileError(f"invalid {option}: {where} has num_heads {config.num_heads!r} "
                            f"(1..16)")
    if any(not path or len(path) > config.num_heads or min(path) < 0
           or max(path) >= TREE_TOP_K for path in config.tree):
        raise HeadFileError(f"invalid {option}: {where} holds a tree path outside "
                            f"{config.num_heads} heads x top {TREE_TOP_K}")
    return config


def load_heads(config: MedusaConfig, path: str, model: nn.Module, dtype: torch.dtype,
               device: torch.device, option: str) -> MedusaHeads:
    """The heads of the folder `path` whose config was read, checked against `model`."""
    check_same_target(config.target, config.target_shape, config.fingerprint, model, option,
                      "the speculator was trained")
    heads = MedusaHeads(config)
    load_weights(heads, path, option)
    return heads.to(device=device, dtype=dtype).eval()
