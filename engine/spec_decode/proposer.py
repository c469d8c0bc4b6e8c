"""Draft proposer interface. Implementations: draft model, prompt lookup (n-gram).

A proposer must not schedule or verify: it is told which sequences to draft for and how many
tokens each (k_i, chosen by the engine), and returns the drafts with their probabilities.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.sample.sampler import RowSpec
from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most k_i tokens (fewer when nothing matches)
    probs: list[torch.Tensor | None]  # per sequence [len, V] processed draft probabilities, or
    #                                   None when drafts are deterministic (one-hot q)
    # (tokens, sequences, seconds) of each model forward it ran, for the cost model
    forward_seconds: list[tuple[int, int, float]] = field(default_factory=list)


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int],
                rows: Callable[[int, list[int]], RowSpec]) -> Proposal:
        """Draft k_i tokens after each sequence's committed tokens.

        `rows(i, drafts_so_far)` gives the sampler's RowSpec for sequence i at the position
        after `drafts_so_far`, so a model proposer samples from the same processed distribution
        the verifier uses for q.
        """

    def free(self, seq: Sequence) -> None:
        """The sequence left the running set (finished or preempted): forget per-sequence state."""
