"""Draft proposer interface. Implementations: draft model, prompt lookup (n-gram).

A proposer must not schedule or verify: it is told which sequences to draft for and how many
tokens each (k_i, chosen by the engine), and returns the drafts with their probabilities.
A proposer whose drafts come out of a device may leave them there (`Proposal.device`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.device_io import Marks
from engine.sample.sampler import RowSpec
from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most k_i tokens (fewer when nothing matches);
    #                             PLACEHOLDER where only `device` holds the token
    probs: list[torch.Tensor | None]  # per sequence [len, V] processed draft probabilities, or
    #                                   None when drafts are deterministic (one-hot q)
    # (tokens, sequences, start, end) of each model forward it ran, for the cost model: marks
    # of `marks`, readable once the device has run the forwards (after the next fetch)
    forwards: list[tuple[int, int, object, object]] = field(default_factory=list)
    marks: Marks | None = None
    # [sequences, max k] the drafts on the device, not read by the host: the next step feeds
    # them to the target and the verifier from there and reads them with its results
    device: torch.Tensor | None = None

    def forward_seconds(self) -> list[tuple[int, int, float]]:
        """(tokens, sequences, seconds) of each forward; only once the device has run them."""
        return [(n, s, self.marks.seconds(a, b)) for n, s, a, b in self.forwards]

    def device_seconds(self) -> float:
        """From the first forward's start to the last one's end, on the device's clock."""
        if not self.forwards:
            return 0.0
        return self.marks.seconds(self.forwards[0][2], self.forwards[-1][3])


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
