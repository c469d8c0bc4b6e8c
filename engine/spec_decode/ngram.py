"""Prompt lookup (n-gram) proposer: drafts by matching the sequence's own suffix. No model, no q.

For n from `max_n` down to `min_n`: find the most recent earlier occurrence of the last n tokens
in the sequence (prompt and output) and propose the (up to k) tokens that followed it. Draft
probabilities are None: the verifier treats the draft as one-hot.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence
from engine.spec_decode.proposer import Proposal, Proposer


def ngram_lookup(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # candidate starts: positions s < length - n where arr[s:s+n] == suffix
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("invalid speculative config: need 1 <= ngram_min_n <= ngram_max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        """Drafts depend on the tokens alone, not on the sampling settings."""
        drafts = [ngram_lookup(s.token_ids, k, self.min_n, self.max_n) for s, k in zip(seqs, ks)]
        return Proposal(drafts, [None] * len(seqs))
