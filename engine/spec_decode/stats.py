"""Speculation statistics: plain counters (the metrics module exports them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    k_max: int = 0
    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by those verifications (accepted + 1 each)
    accepted_per_pos: list[int] = field(default_factory=list)  # [k_max] accepted at position j
    k_chosen_sum: int = 0  # sum of k chosen over drafting decisions (k = 0 included)
    k_chosen_count: int = 0
    last_mean_k: float = 0.0  # mean k chosen in the latest step that had decoding sequences
    draft_seconds: float = 0.0
    # per method ("draft_model", "suffix", "ngram"): [verifications, drafted, accepted]
    by_method: dict[str, list[int]] = field(default_factory=dict)
    suffix_cache_tokens: int = 0  # finished requests' tokens the suffix cache holds
    num_tree_verifications: int = 0  # verifications whose drafts were a token tree
    num_tree_nodes: int = 0  # the nodes those trees verified
    tree_verifications_by_method: dict[str, int] = field(default_factory=dict)
    # steps where trees were on and possible but the guard had the proposers draft chains
    # (their trees realized less than their chains at that batch size)
    num_chain_steps_chosen: int = 0
    # tokens emitted by each recent verification with drafts, for a metrics consumer
    recent_lengths: deque = field(default_factory=lambda: deque(maxlen=10_000))

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k_max

    def record_choice(self, ks: list[int]) -> None:
        self.k_chosen_sum += sum(ks)
        self.k_chosen_count += len(ks)
        self.last_mean_k = sum(ks) / len(ks) if ks else 0.0

    def record_verification(self, num_drafted: int, num_accepted: int,
                            method: str = "draft_model", tree: bool = False) -> None:
        if not num_drafted:
            return
        if tree:
            self.num_tree_verifications += 1
            self.num_tree_nodes += num_drafted
            self.tree_verifications_by_method[method] = \
                self.tree_verifications_by_method.get(method, 0) + 1
        counts = self.by_method.setdefault(method, [0, 0, 0])
        counts[0] += 1
        counts[1] += num_drafted
        counts[2] += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        self.recent_lengths.append(num_accepted + 1)
        for j in range(min(num_accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[j] += 1

    def take_recent_lengths(self) -> list[int]:
        lengths = list(self.recent_lengths)
        self.recent_lengths.clear()
        return lengths

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification that had drafts (accepted + the final token)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_k(self) -> float:
        return self.k_chosen_sum / self.k_chosen_count if self.k_chosen_count else 0.0
