"""Draft proposer interface. Implementations: draft model, prompt lookup (n-gram).

A proposer must not schedule or verify: it is told which sequences to draft for and how many
tokens each (k_i, chosen by the speculator), and returns the drafts with their probabilities.
A proposer whose drafts come out of a device may leave them there (`Proposal.device`); a model
proposer samples from the rows `engine/sample/row_spec.py` describes, as the verifier does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
import torch

from engine.device_io import Marks
from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[list[int]] | None  # per sequence, at most k_i tokens (fewer when nothing
    #                                    matches); None when only `device` holds them
    probs: list[torch.Tensor | None]  # per sequence [len, V] processed draft probabilities, or
    #                                   None when drafts are deterministic (one-hot q)
    # (tokens, sequences, start, end) of each model forward it ran, for the cost model: marks
    # of `marks`, readable once the device has run the forwards (after the next fetch)
    forwards: list[tuple[int, int, object, object]] = field(default_factory=list)
    marks: Marks | None = None
    # [sequences, max k] the drafts on the device, not read by the host: the next step feeds
    # them to the target and the verifier from there and reads them with its results
    device: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)  # drafts per sequence (from token_ids)
    # token trees (`propose_tree`): per sequence its drafts' parents (engine/batch.py) and
    # each node's predicted chance of acceptance (its path's probability under the proposer)
    parents: list[list[int]] | None = None
    confidence: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if self.token_ids is not None:
            self.lengths = [len(t) for t in self.token_ids]

    def forward_seconds(self) -> list[tuple[int, int, float]]:
        """(tokens, sequences, seconds) of each forward; only once the device has run them."""
        return [(n, s, self.marks.seconds(a, b)) for n, s, a, b in self.forwards]

    def device_seconds(self) -> float:
        """From the first forward's start to the last one's end, on the device's clock."""
        if not self.forwards:
            return 0.0
        return self.marks.seconds(self.forwards[0][2], self.forwards[-1][3])


class Proposer(ABC):
    trees = False  # drafts token trees too (`propose_tree`)
    # ... and sampled ones for requests verified by rejection (`propose_sampled_tree`)
    sampled_trees = False
    method = ""  # its name in counters: draft_model, eagle, medusa, ngram

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        """Draft k_i tokens after each sequence's committed tokens."""

    def forget(self, seq: Sequence) -> None:
        """The sequence left the running set (finished or preempted): forget per-sequence state."""

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      hidden: torch.Tensor) -> None:
        """The target's hidden states of its last pass (proposers that read them: a head)."""

    def backlog(self, seq: Sequence) -> int:
        """Tokens the proposer must catch up on before it drafts for `seq`."""
        return seq.num_tokens - seq.num_draft_computed
