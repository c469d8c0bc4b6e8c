"""The verifier: exact speculative sampling over flattened tensors. A pure function.

Terms, defined once:
- draft tokens: the k_i tokens proposed for sequence i (k_i may be 0), flattened over the batch
  with `num_draft_tokens` giving each sequence's count.
- p: the target's processed distribution at a position; q: the draft's (None = one-hot on the
  draft token, as for n-gram drafts). Both come from `sampler.process_logits` with the same
  settings, so exactness holds for every sampling setting.
- accepted: draft token x at position j is kept with probability min(1, p_j(x) / q_j(x))
  (greedy: iff x == argmax p_j). Sequence i keeps the longest accepted prefix.
- recovered token: at the first rejected position j, a token drawn from
  normalize(max(p_j - q_j, 0)) (greedy: argmax p_j).
- bonus token: when all k_i drafts are accepted, a token drawn from p at position k_i (the row
  after the last draft).
Every sequence therefore emits (accepted drafts) + 1 tokens, and each emitted token has exactly
the target's distribution (Leviathan et al. 2023; Chen et al. 2023).

Randomness: uniforms for acceptance and exponential noise for the final draw (the exponential
race argmax(r / E) samples from normalize(r)). A sequence with its own generator draws all of
them from it, in a fixed order, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import exponential_noise

PLACEHOLDER = -1


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] long
    num_draft_tokens: list[int],  # [B]
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float, or None (one-hot drafts)
    target_probs: torch.Tensor,  # [num_draft_tokens + B, V]: k_i + 1 rows per sequence. Rows
    #                              of greedy sequences only need the right argmax.
    greedy: list[bool],  # [B]
    generators: list[torch.Generator | None],  # [B] a sequence's own generator, if seeded
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:  # [B, max_k + 1] long: emitted tokens, padded with PLACEHOLDER
    """Verify every sequence's drafts at once (terms in the module docstring).

    Longer than most functions on purpose: acceptance, then the final token, then the output,
    read top to bottom like the algorithm, over the same index tensors.
    """
    device = target_probs.device
    batch, max_k = len(num_draft_tokens), max(num_draft_tokens, default=0)
    k = torch.tensor(num_draft_tokens, device=device)  # [B]
    draft_start = torch.cumsum(k, 0) - k  # [B] offset of each sequence's drafts
    target_start = draft_start + torch.arange(batch, device=device)  # [B] its first target row
    pos = torch.arange(max_k, device=device)[None, :]  # [1, K]
    d_idx = (draft_start[:, None] + pos).clamp(max=max(draft_token_ids.numel() - 1, 0))
    drafts = draft_token_ids[d_idx] if max_k else torch.zeros((batch, 0), dtype=torch.long,
                                                               device=device)  # [B, K]
    t_rows = (target_start[:, None] + pos).clamp(max=target_probs.shape[0] - 1)  # [B, K]
    is_greedy = torch.tensor(greedy, dtype=torch.bool, device=device)  # [B]

    if max_k:
        # -- acceptance ----------------------------------------------------------------------
        p_x = target_probs[t_rows, drafts]  # [B, K]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[d_idx, drafts]
        uniform = _uniforms((batch, max_k), num_draft_tokens, greedy, generators,
                            default_generator, device)
        # q >= p: accept with probability p/q; q < p: always (uniform < 1 <= p/q)
        sampled_ok = uniform * q_x < p_x
        greedy_ok = drafts == target_probs.argmax(dim=-1)[t_rows]
        accepted = torch.where(is_greedy[:, None], greedy_ok, sampled_ok) & (pos < k[:, None])
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)

    # -- the final token: recovered at the first rejection, else bonus ------------------------
    dist = target_probs[target_start + num_accepted]  # [B, V]
    final = dist.argmax(dim=-1)  # greedy: the target's own token, recovered or bonus
    if not all(greedy):
        at = num_accepted.clamp(max=max(max_k - 1, 0))[:, None]  # [B, 1] the first rejection
        rejected_draft = drafts.gather(1, at) if max_k else at  # [B, 1]
        q_row = None if draft_probs is None else draft_probs[d_idx.gather(1, at)[:, 0]]  # [B, V]
        dist = _recovered_or_bonus(dist.float(), num_accepted < k, rejected_draft, q_row)
        gens = [None if g else gen for g, gen in zip(greedy, generators)]
        noise = exponential_noise(tuple(dist.shape), gens, device, default_generator)
        final = torch.where(is_greedy, final, (dist / noise).argmax(dim=-1))

    out = torch.full((batch, max_k + 1), PLACEHOLDER, dtype=torch.long, device=device)
    if max_k:
        keep = pos < num_accepted[:, None]
        out[:, :max_k] = torch.where(keep, drafts, out[:, :max_k])
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out


def _recovered_or_bonus(p: torch.Tensor, rejected: torch.Tensor, rejected_draft: torch.Tensor,
                        q: torch.Tensor | None) -> torch.Tensor:
    """[B, V] the distribution of each sequence's final token: normalize(max(p - q, 0)) where
    a draft was `rejected` ([B] bool), p itself (the bonus token) where all were accepted.

    p: [B, V] target probabilities at the final row; rejected_draft: [B, 1] the rejected draft
    token; q: [B, V] its draft probabilities, or None for one-hot drafts.
    """
    if not bool(rejected.any()):
        return p
    if q is None:
        residual = p.scatter(1, rejected_draft, 0.0)  # q one-hot on the draft
    else:
        residual = (p - q).clamp_min(0.0)
    # a zero residual happens only when p == q numerically (rejection has prob. 0)
    usable = rejected & (residual.sum(dim=-1) > 0)
    return torch.where(usable[:, None], residual, p)


def _uniforms(shape: tuple[int, int], num_draft_tokens: list[int], greedy: list[bool],
              generators: list[torch.Generator | None], default: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """[B, K] U(0, 1); a seeded sampled sequence draws its k_i from its own generator first."""
    uniform = torch.rand(shape, generator=default, device=device)
    for i, (k, g, gen) in enumerate(zip(num_draft_tokens, greedy, generators)):
        if gen is not None and k and not g:
            uniform[i, :k] = torch.rand(k, generator=gen, device=device)
    return uniform


def to_lists(emitted: torch.Tensor) -> list[list[int]]:
    """[B, max_k + 1] padded -> emitted tokens per sequence."""
    return [[t for t in row if t != PLACEHOLDER] for row in emitted.tolist()]
