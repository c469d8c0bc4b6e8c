"""Suffix speculation: drafts from the longest recent match of a sequence's suffix in its own
text and in earlier requests' prompts and outputs (a bounded cache, partitioned by tenant).

The structure is a hash index of anchored suffixes, not a suffix tree or automaton. For each
anchor length A in `ANCHORS`, a dict maps the hash of every A-token window of every cached text
to the most recent `max_occurrences` positions that end it. A lookup takes the longest anchor
whose bucket is not empty, extends each candidate's match backwards token by token (up to
`max_match`) and keeps the candidates with the longest match: the occurrences a suffix tree's
deepest matching node would hold, found without the tree. Why this over a tree:
- memory is A_count entries per cached token, where a depth-limited suffix trie built in
  Python holds up to `depth` nodes per token (tens of objects each);
- appending a token is one dict update per anchor (amortized O(1)); a trie pays `depth`;
- eviction needs no reference counts: an evicted text leaves the document table at once
  (lookups skip positions of documents that are gone), and its positions are removed from
  the buckets a few thousand per step (`maintain`), so no step waits for a large eviction;
- a hash collision cannot produce a wrong candidate: every candidate's match is compared
  token by token.

A proposal follows the candidates forward: at each position the most frequent next token among
those still agreeing (ties: the most recent) with its empirical probability; drafting stops
when the cumulative probability falls under `min_token_prob`, after `spec_factor` x the match
length, or at `max_spec_tokens`. Its confidence per position j (the predicted chance that
drafts 1..j are all accepted) is that probability times a^j, where a is the acceptance measured
for earlier proposals of the same match-length class in the same partition (long exact matches
earn a near 1, short ones in prose much less; before any measurement a prior that grows with
the match length). The cost model reads these confidences.

Isolation: every cached text belongs to the partition of its request's `cache_salt` (the prefix
cache's tenant key). Lookups, statistics and LRU order never cross partitions; when the token
budget is exceeded the least recently used finished text of the LARGEST partition is evicted,
so a tenant within its fair share is never evicted by another's traffic. With
`cross_request=False` each sequence sees only its own text and nothing outlives a request.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats

ANCHORS = (2, 6, 16)  # anchor lengths, shortest first: the shortest is the minimum match
_SHIFT = 1 << 32  # index entries pack (document id, end position)
NUM_CLASSES = 7  # match-length classes: 1-2, 3-4, 5-8, 9-16, 17-32, 33-64, 65+


def match_class(length: int) -> int:
    return min(max(length - 1, 1).bit_length() - 1, NUM_CLASSES - 1)


@dataclass
class SuffixDraft:
    """A proposal: tokens and, per position j, the predicted chance drafts 1..j are accepted."""

    token_ids: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    match_length: int = 0
    # a token tree (`propose_tree`): each token's parent (-1: the last committed token), the
    # nodes in order of confidence, so that the first k of them are a tree too; None: a chain
    parents: list[int] | None = None


class _Document:
    __slots__ = ("indexed", "salt", "tokens")

    def __init__(self, salt) -> None:
        self.tokens: list[int] = []
        self.indexed = 0  # leading tokens whose windows are in the index
        self.salt = salt


class _Partition:
    """One tenant's texts and their index."""

    def __init__(self) -> None:
        self.index: dict[int, dict[int, list[int]]] = {a: {} for a in ANCHORS}
        self.history: OrderedDict[int, int] = OrderedDict()  # finished doc id -> tokens, LRU
        self.history_tokens = 0
        self.live = 0  # documents of running sequences
        # per match-length class: accepted drafts / rejections of earlier proposals
        self.acceptance = [AcceptanceStats() for _ in range(NUM_CLASSES)]


class SuffixCache:
    def __init__(self, *, max_tokens: int = 262_144, cross_request: bool = True,
                 max_spec_tokens: int = 32, max_match: int = 64, spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_occurrences: int = 32) -> None:
        self.max_tokens = max_tokens
        self.cross_request = cross_request and max_tokens > 0
        self.max_spec_tokens = max_spec_tokens
        self.max_match = max_match
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        self.max_occurrences = max_occurrences
        self.decay = 0.995  # per recorded verification, so acceptance follows the traffic
        self._docs: dict[int, _Document] = {}
        self._partitions: dict[object, _Partition] = {}
        self._doc_of: dict[str, int] = {}  # request id -> its live document
        self._next_id = 0
        self._history_tokens = 0  # over all partitions
        self._cleanup: deque[tuple[object, list[int], int]] = deque()  # evicted: (partition
        #                                  key, tokens, doc id), their index entries to remove
        self.update_seconds = 0.0  # time spent indexing, evicting and cleaning up
        self.max_update_seconds = 0.0  # the longest single update

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens of finished requests held for other requests (the budgeted part)."""
        return self._history_tokens

    @property
    def num_live(self) -> int:
        return len(self._doc_of)

    def _key(self, seq: Sequence):
        return ("salt", seq.cache_salt) if self.cross_request else ("seq", seq.request_id)

    def _timed(self, started: float) -> None:
        seconds = time.perf_counter() - started
        self.update_seconds += seconds
        self.max_update_seconds = max(self.max_update_seconds, seconds)

    def sync(self, seq: Sequence) -> None:
        """Index the sequence's committed tokens not indexed yet (its prompt the first time)."""
        started = time.perf_counter()
        doc_id = self._doc_of.get(seq.request_id)
        if doc_id is None:
            doc_id = self._next_id
            self._next_id += 1
            self._docs[doc_id] = _Document(self._key(seq))
            self._doc_of[seq.request_id] = doc_id
            self._partitions.setdefault(self._key(seq), _Partition()).live += 1
        doc = self._docs[doc_id]
        doc.tokens.extend(seq.token_ids[len(doc.tokens):])
        self._index(self._partitions[doc.salt], doc_id, doc)
        self._timed(started)

    def _index(self, part: _Partition, doc_id: int, doc: _Document) -> None:
        tokens, cap = doc.tokens, self.max_occurrences
        for end in range(max(doc.indexed + 1, ANCHORS[0]), len(tokens) + 1):
            entry = doc_id * _SHIFT + end
            for a in ANCHORS:
                if end < a:
                    break
                bucket = part.index[a].setdefault(hash(tuple(tokens[end - a:end])), [])
                bucket.append(entry)
                if len(bucket) > cap:
                    del bucket[0]
        doc.indexed = len(tokens)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: its full text joins its partition's history (or is dropped
        when texts are not shared across requests), within the token budget."""
        if seq.request_id not in self._doc_of and not self.cross_request:
            return
        self.sync(seq)  # a sequence never proposed for (opted out) still becomes history
        started = time.perf_counter()
        doc_id = self._doc_of.pop(seq.request_id)
        doc = self._docs[doc_id]
        key, part = doc.salt, self._partitions[doc.salt]
        part.live -= 1
        if not self.cross_request:
            del self._docs[doc_id]
            del self._partitions[key]  # the sequence's own partition, index and all
        else:
            part.history[doc_id] = len(doc.tokens)
            part.history_tokens += len(doc.tokens)
            self._history_tokens += len(doc.tokens)
            while self.num_tokens > self.max_tokens:
                key, largest = max(self._partitions.items(), key=lambda kv: kv[1].history_tokens)
                self._evict(key, largest, next(iter(largest.history)))
        self._timed(started)

    def _evict(self, key, part: _Partition, doc_id: int) -> None:
        doc = self._docs.pop(doc_id)
        removed = part.history.pop(doc_id)
        part.history_tokens -= removed
        self._history_tokens -= removed
        if not part.history and not part.live:
            del self._partitions[key]  # nothing left: its index goes with it
        else:
            self._cleanup.append((key, doc.tokens, doc_id))

    def maintain(self, budget: int = 4096) -> None:
        """Remove up to `budget` token positions of evicted texts from the index (called once
        per step); stale positions are skipped by lookups until then."""
        if not self._cleanup:
            return
        started = time.perf_counter()
        while self._cleanup and budget > 0:
            key, tokens, doc_id = self._cleanup[0]
            part = self._partitions.get(key)
            n = min(budget, len(tokens))
            if part is not None:  # else the partition is gone, and its index with it
                lo, hi = doc_id * _SHIFT, (doc_id + 1) * _SHIFT
                for end in range(max(len(tokens) - n + 1, ANCHORS[0]), len(tokens) + 1):
                    for a in ANCHORS:
                        if end < a:
                            break
                        index = part.index[a]
                        h = hash(tuple(tokens[end - a:end]))
                        bucket = index.get(h)
                        if bucket is None:
                            continue
                        kept = [e for e in bucket if not lo <= e < hi]
                        if kept:
                            index[h] = kept
                        else:
                            del index[h]
            del tokens[len(tokens) - n:]
            budget -= max(n, 1)
            if not tokens:
                self._cleanup.popleft()
        self._timed(started)

    @property
    def num_index_entries(self) -> int:
        return sum(len(b) for p in self._partitions.values() for index in p.index.values()
                   for b in index.values())

    # -- proposals -------------------------------------------------------------------------------
    @staticmethod
    def prior(cls: int) -> float:
        """Acceptance assumed for a match class before any verification: 1 - 0.7 x 2^-class,
        0.3 for a 1-2 token match (chat text matches short phrases everywhere), 0.65 for 3-4,
        up to 0.98 for 33-64 (a long match is likely a repeat). A class whose drafts are never
        chosen is never measured, so the long classes start optimistic."""
        return 1.0 - 0.7 * 0.5 ** cls

    def _lookup(self, seq: Sequence, max_tokens: int
                ) -> tuple[list[tuple[list[int], int]], int, int, float] | None:
        """The sequence's longest recent match: its candidates (texts and the positions after
        the match), the match length, how far a proposal may go (`max_tokens`, the spec
        factor, max_spec_tokens) and its class's acceptance; None without one."""
        doc_id = self._doc_of.get(seq.request_id)
        if doc_id is None or max_tokens <= 0:
            return None
        doc = self._docs[doc_id]
        part = self._partitions[doc.salt]
        found = self._matches(part, doc.tokens)
        if not found:
            return None
        best = max(f[0] for f in found)
        cands = [(toks, pos) for m, _, toks, pos in found if m == best]
        for _, other, _, _ in found:
            if other in part.history:
                part.history.move_to_end(other)  # recently useful: evicted last
        cap = min(max_tokens, self.max_spec_tokens, max(1, int(self.spec_factor * best)))
        cls = match_class(best)
        return cands, best, cap, part.acceptance[cls].estimate(self.prior(cls))

    def propose(self, seq: Sequence, max_tokens: int) -> SuffixDraft:
        """The continuation of the sequence's longest recent match, at most `max_tokens` long
        (call `sync` first)."""
        match = self._lookup(seq, max_tokens)
        if match is None:
            return SuffixDraft()
        cands, best, cap, acceptance = match
        return self._continuation(cands, cap, acceptance, SuffixDraft(match_length=best))

    def propose_tree(self, seq: Sequence, max_depth: int, max_nodes: int) -> SuffixDraft:
        """The continuations of the sequence's longest recent match as a token tree of at most
        `max_nodes` nodes and `max_depth` levels: every next token of the candidates whose
        path frequency stays above min_token_prob, the most confident first (a chain where
        one continuation dominates). A node's confidence is its path's frequency times the
        match class's acceptance per level, like a chain's position (call `sync` first)."""
        match = self._lookup(seq, max_depth) if max_nodes > 0 else None
        if match is None:
            return SuffixDraft()
        cands, best, cap, acceptance = match
        draft = SuffixDraft(match_length=best, parents=[])
        # best first: (-confidence, order, parent, token, its path frequency, depth, candidates)
        heap: list = []
        order = itertools.count()

        def expand(parent: int, cands: list, prob: float, depth: int) -> None:
            if depth >= cap:
                return
            counts: dict[int, list] = {}
            for toks, pos in cands:
                if pos < len(toks):
                    counts.setdefault(toks[pos], []).append((toks, pos + 1))
            for token, follow in counts.items():  # insertion order: ties -> the most recent
                p = prob * len(follow) / len(cands)
                if p >= self.min_token_prob:
                    heapq.heappush(heap, (-p * acceptance ** (depth + 1), next(order), parent,
                                          token, p, depth + 1, follow))

        expand(-1, cands, 1.0, 0)
        while heap and len(draft.token_ids) < max_nodes:
            conf, _, parent, token, p, depth, follow = heapq.heappop(heap)
            draft.token_ids.append(token)
            draft.confidence.append(-conf)
            draft.parents.append(parent)
            expand(len(draft.token_ids) - 1, follow, p, depth)
        return draft

    def _matches(self, part, ctx: list[int]) -> list[tuple[int, int, list[int], int]]:
        """(match length, doc id, its tokens, the position after the match) of every earlier
        occurrence of ctx's end at the longest anchor that has one, most recent first."""
        n = len(ctx)
        found: list[tuple[int, int, list[int], int]] = []
        for a in reversed(ANCHORS):
            if n < a:
                continue
            bucket = part.index[a].get(hash(tuple(ctx[n - a:n])))
            if not bucket:
                continue
            for entry in reversed(bucket):  # most recent first
                other, end = divmod(entry, _SHIFT)
                odoc = self._docs.get(other)
                if odoc is None or end >= len(odoc.tokens):
                    continue  # evicted, or no continuation yet (the sequence's own end)
                toks, m, limit = odoc.tokens, 0, min(self.max_match, end, n)
                while m < limit and toks[end - 1 - m] == ctx[n - 1 - m]:
                    m += 1
                if m >= a:  # not a hash collision
                    found.append((m, other, toks, end))
            if found:
                break
        return found

    def _continuation(self, cands: list[tuple[list[int], int]], cap: int, acceptance: float,
                      draft: SuffixDraft) -> SuffixDraft:
        """`draft` extended, up to `cap` tokens, by the most frequent next token of the
        candidates (texts and positions) while its frequency stays above min_token_prob."""
        prob, acc = 1.0, 1.0
        while len(draft.token_ids) < cap and cands:
            counts: dict[int, int] = {}
            for toks, pos in cands:
                if pos < len(toks):
                    counts[toks[pos]] = counts.get(toks[pos], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.get)  # dicts keep insertion order: ties -> recent
            prob *= counts[token] / len(cands)
            if prob < self.min_token_prob:
                break
            acc *= acceptance
            draft.token_ids.append(token)
            draft.confidence.append(prob * acc)
            cands = [(toks, pos + 1) for toks, pos in cands
                     if pos < len(toks) and toks[pos] == token]
        return draft

    def record(self, seq: Sequence, match_length: int, num_drafted: int, num_accepted: int,
               rejected: bool) -> None:
        """A verification of a suffix proposal: feeds the acceptance of its match class
        (rejected: the accepted path ended where the proposal went on)."""
        doc_id = self._doc_of.get(seq.request_id)
        if doc_id is None or not num_drafted:
            return
        part = self._partitions[self._docs[doc_id].salt]
        for st in part.acceptance:
            st.accepted *= self.decay
            st.rejections *= self.decay
        st = part.acceptance[match_class(match_length)]
        st.accepted += num_accepted
        st.rejections += rejected
