"""A drafted row's loss against the target's distribution p (its top TOP_K next tokens,
renormalized over the draft vocabulary), given the head's logits; one for every head kind
(training/speculator.py, training/medusa.py).

- "ce": the soft cross-entropy -sum_x p(x) log q(x). With p cut to the target's top TOP_K it
  is HASS's top-K distillation.
- "accept": the acceptance-rate objective -log sum_x min(p(x), q(x)): the log of the chance
  that speculative sampling accepts a draft sampled from q under the target.
"""

from __future__ import annotations

import torch

LOSSES = ("ce", "accept")


def row_losses(target: torch.Tensor, logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[rows] each row's loss: target [rows, V] probabilities, logits [rows, V]."""
    if kind == "accept":
        q = torch.softmax(logits.float(), dim=-1)
        return -torch.log(torch.minimum(target, q).sum(1).clamp(min=1e-6))
    if kind != "ce":
        raise ValueError(f"loss: expected one of {', '.join(LOSSES)}, got {kind!r}")
    return -(target * torch.log_softmax(logits.float(), dim=-1)).sum(1)
