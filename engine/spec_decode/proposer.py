"""Draft proposer interface. Implementations: draft model, prompt lookup (n-gram).

A proposer must not schedule or verify: it is told which sequences to draft for and how many
tokens each (k_i, chosen by the engine), and returns the drafts with their probabilities.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most k_i tokens (fewer when nothing matches)
    probs: list[torch.Tensor | None]  # per sequence [len, V] processed draft probabilities, or
    #                                   None when drafts are deterministic (one-hot q)


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int], rows=None) -> Proposal:
        """Draft k_i tokens after each sequence's committed tokens.

        `rows(i, drafts_so_far)` gives the sampler's RowSpec for sequence i at the position
        after `drafts_so_far`, so a model proposer samples from the same processed distribution
        the verifier uses for q.
        """

    def free(self, seq: Sequence) -> None:
        """The sequence left the running set (finished or preempted): forget per-sequence state."""
