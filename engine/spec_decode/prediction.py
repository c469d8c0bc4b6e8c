"""Predicted Outputs: drafts from the text a caller expects the answer to be (OpenAI's
`prediction`, e.g. the file being edited), re-aligned after every edit. No torch.

A request's prediction (token ids) is matched against the tail of its output. Where the answer
follows the prediction, the next drafts are the prediction's continuation from where the
answer is in it (the cursor). Where the answer departs from it (an edit), nothing is proposed
until the answer's last ANCHOR tokens occur in the prediction again: an insertion (text the
prediction lacks) re-aligns once the answer is back on the prediction's text, a deletion (a
span skipped) or a replacement likewise, at the occurrence nearest after the cursor (an edit
keeps the answer in the prediction's order; an earlier occurrence is taken only where no later
one exists). The tail's match is extended backwards to tell a long, trustworthy alignment from
a short coincidence.

Confidence per draft position j (the predicted chance that drafts 1..j are all accepted, what
the guard's cost model reads, as for suffix proposals): a^j, where a is the acceptance of this
request's prediction drafts so far, with a high prior (a caller's prediction of an edit is
mostly right), lowered for an alignment shorter than ANCHOR + 2 tokens.
"""

from __future__ import annotations

import bisect

from engine.spec_decode.adaptive import AcceptanceStats
from engine.spec_decode.suffix import SuffixDraft

ANCHOR = 4  # answer tokens that must occur in the prediction to re-align after an edit
MAX_MATCH = 64  # how far back an alignment's length is measured
PRIOR = 0.9  # acceptance of a prediction's drafts before any was verified
SHORT_MATCH_FACTOR = 0.7  # a fresh alignment of few tokens may be a coincidence


class PredictionMatcher:
    """One request's prediction, its index of ANCHOR-token windows and its alignment."""

    def __init__(self, prediction: list[int]) -> None:
        self.tokens = list(prediction)
        self._index = window_index(self.tokens)
        self.cursor = 0  # where in the prediction the answer is, as far as known
        self.stats = AcceptanceStats()
        self.num_accepted = 0  # prediction tokens verified and accepted as drafts

    def propose(self, output: list[int], max_tokens: int) -> SuffixDraft:
        """The prediction's continuation after the answer `output` (its tokens so far), at
        most `max_tokens` long; empty where the answer is not aligned with it."""
        if max_tokens <= 0 or not self.tokens:
            return SuffixDraft()
        position = self._align(output)
        if position is None or position >= len(self.tokens):
            return SuffixDraft()
        self.cursor = position
        match = self._match_length(output, position)
        a = self.stats.estimate(PRIOR)
        if match < ANCHOR + 2 and len(output) > match:  # (the answer's start is no coincidence)
            a *= SHORT_MATCH_FACTOR
        drafts = self.tokens[position:position + max_tokens]
        return SuffixDraft(drafts, [a ** (j + 1) for j in range(len(drafts))], match)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of drafts this matcher proposed from `cursor`."""
        if not num_drafted:
            return
        self.stats.accepted += num_accepted
        self.stats.rejections += num_accepted < num_drafted
        self.num_accepted += num_accepted
        self.cursor += num_accepted

    def _align(self, output: list[int]) -> int | None:
        """Where in the prediction the answer's next token is expected (None: not aligned)."""
        n, c = len(output), self.cursor
        for position in (c + 1, c):  # still following (the usual case): the bonus token, or
            if 0 < position <= len(self.tokens) and n \
                    and self._match_length(output, position) >= min(n, ANCHOR):
                return position  # the last accepted draft, ends the answer
        if n < ANCHOR:  # the answer's start: aligned only with the prediction's start
            return n if output == self.tokens[:n] else None
        ends = self._index.get(tuple(output[-ANCHOR:]))
        if not ends:
            return None
        later = bisect.bisect_left(ends, c)
        return ends[later] if later < len(ends) else ends[-1]

    def _match_length(self, output: list[int], position: int) -> int:
        """How many of the answer's last tokens equal the prediction's before `position`."""
        m, limit = 0, min(len(output), position, MAX_MATCH)
        while m < limit and output[-1 - m] == self.tokens[position - 1 - m]:
            m += 1
        return m


def window_index(tokens: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Each window of ANCHOR tokens -> the positions just after its occurrences, rising."""
    index: dict[tuple[int, ...], list[int]] = {}
    for end in range(ANCHOR, len(tokens) + 1):
        index.setdefault(tuple(tokens[end - ANCHOR:end]), []).append(end)
    return index


def predicted_tokens(prediction: list[int], answer: list[int]) -> int:
    """Tokens of the prediction that appear in the answer, in order: OpenAI's accepted
    prediction tokens (the rest are its rejected ones). The answer is walked once: a token equal
    to the prediction's next one counts; after a departure (an edit) the answer's last ANCHOR
    tokens, all after the departure, re-align it at their next occurrence in the prediction,
    never an earlier one, and count. Linear in both lengths; a property of the answer alone,
    the same whether speculation drafted the tokens or not."""
    index = window_index(prediction)
    count, cursor, departed = 0, 0, None  # departed: the answer's index where it left
    for i, token in enumerate(answer):
        if departed is None:
            if cursor < len(prediction) and prediction[cursor] == token:
                count, cursor = count + 1, cursor + 1
                continue
            departed = i
        if i - departed + 1 < ANCHOR:
            continue
        ends = index.get(tuple(answer[i + 1 - ANCHOR:i + 1]), ())
        later = bisect.bisect_left(ends, cursor + ANCHOR)
        if later < len(ends):
            count, cursor, departed = count + ANCHOR, ends[later], None
    return count
