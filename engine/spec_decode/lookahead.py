"""Lookahead decoding (Fu et al., ICML 2024): drafts without a draft model, from an n-gram pool
that the target's own Jacobi iterations fill.

Must not schedule or verify. Per request it keeps:
- a **pool** of n-grams of `ngram` tokens keyed by their first token: every n-gram of the
  request's prompt and committed output ("text"), and the trajectories of its window
  ("window"). The verification branch of a step is up to `max_candidates` continuations of the
  last committed token, merged into a token tree (shared prefixes once) whose nodes carry a
  calibrated chance of acceptance: a free proposal, priced by the guard like a suffix match
  and verified by the tree verifier like every draft.
- a **window** of `window` future positions x up to `ngram` - 1 levels (past Jacobi
  iterations): level l's token i is a guess of the token at index `base + l + i` of the
  sequence. Its rows run in the same forward as the verification branch, as nodes of the same
  token tree hanging off the last committed token: level 0 is a chain, and level l's token i
  is the child of level l - 1's token i, so it reads the committed text, level 0's guesses up
  to its column, and its column's guesses below it. Tree attention keeps the two branches
  blind to each other (a node reads only its ancestors). The lookahead rows are never
  verified (`Drafts.num_lookahead`): the target's argmax at each row of the last level is the
  next level (the Jacobi step), and each full column (`ngram` consecutive guesses) goes into
  the pool. The oldest level then drops, and the window slides to the new last token.

The window's rows are spent only where the guard prices a row below what the window's n-grams
have been measured to bring (accepted tokens per lookahead row); elsewhere (an int4 model on
two CPU cores, a large batch) lookahead is the pool alone. Drafts are one-hot (q = 1 at the
draft): greedy and coupled seeded requests are verified by pick, sampled ones by rejection
sampling over the tree, so the output is exactly (or in distribution) what plain decoding
gives.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.batch import ROOT
from engine.config import LookaheadConfig
from engine.sequence import Sequence
from engine.spec_decode.suffix import SuffixDraft

PRIOR_HITS = (0.35, 0.2, 0.12, 0.08, 0.05)  # a pool proposal's chance to reach depth d
PRIOR_WEIGHT = 4.0  # verifications the prior counts as
SOURCES = ("text", "window")  # where a pool n-gram came from
DECAY = 0.995  # of the shared calibration, per verification
VALUE_DECAY = 0.99  # of the measured value of window rows, per window step
# before (and beside) what it measures, a window row is taken to bring PRIOR_ROW_VALUE
# accepted tokens, weighed as PRIOR_STEPS window steps: the original paper's figures (~0.6
# tokens a step from ~120 rows of a 7B model) and ours (0.005 on the packaged 1.5B) are below it,
# so rows start where they are nearly free (a GPU at batch 1) and elsewhere only probe
PRIOR_ROW_VALUE = 0.01
PRIOR_STEPS = 8
# where rows are priced out, a sequence still runs its window now and then, to measure it: each
# sequence-step of the server earns PROBE_SHARE accepted tokens' worth of credit, and a probe
# spends what its rows cost at the guard's price (rows x price, what they lose if they bring
# nothing), one sequence at a time: exploring costs at most ~PROBE_SHARE of the tokens whatever
# a row costs (an int4 step with the window's 15 rows, ~2x a plain one on two CPU cores: a probe
# every ~120 sequence-steps; bf16 at c = 8, rows far dearer: far rarer)
PROBE_SHARE = 0.015
# the pool's chances are learned from its verified proposals only: where the plan prices every
# proposal out (after a workload where the pool's n-grams missed, e.g. chat before code edits),
# nothing would be verified and nothing learned. So a proposal the plan priced out is verified
# now and then, paid the same way from a smaller share (POOL_PROBE_SHARE per sequence-step
# whose proposal was priced out; a probe costs its nodes x the price of a row)
POOL_PROBE_SHARE = 0.005


class _ProbeCredit:
    """Accepted tokens' worth that probes may spend: every call earns `share`, at most one
    probe's worth is saved up, and a probe spends it all."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._credit = 0.0

    def spend(self, cost: float) -> bool:
        """Whether a probe costing `cost` runs now (this call's share counted first)."""
        self._credit = min(self._credit + self.share, cost)
        if self._credit < cost:
            return False
        self._credit = 0.0
        return True


class NgramPool:
    """Continuations (ngram - 1 tokens) per first token, the most recently seen last; each
    with its source ("text" wins over "window": text proposes it anyway)."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._by_key: dict[int, OrderedDict[tuple[int, ...], str]] = {}

    def add(self, key: int, continuation: tuple[int, ...], source: str) -> None:
        entries = self._by_key.setdefault(key, OrderedDict())
        old = entries.pop(continuation, None)
        entries[continuation] = "text" if "text" in (old, source) else source
        if len(entries) > self.per_key:
            entries.popitem(last=False)

    def get(self, key: int, limit: int) -> list[tuple[tuple[int, ...], str]]:
        """At most `limit` continuations of `key`, the most recent first."""
        entries = self._by_key.get(key)
        if not entries:
            return []
        return list(reversed(entries.items()))[:limit]

    def __len__(self) -> int:
        return sum(len(e) for e in self._by_key.values())


class _Request:
    """One request's lookahead: its pool, its window, and what its pending drafts hold."""

    def __init__(self, config: LookaheadConfig) -> None:
        self.pool = NgramPool(2 * config.max_candidates)
        self.indexed = 0  # tokens whose n-grams are in the pool (from the start)
        self.levels: list[list[int]] = []  # the window: level -> width guesses
        self.base = 0  # level l's token i guesses the sequence's token at base + l + i
        # per source ("text", "window"): its nodes at depth d + 1 that were on the accepted
        # path / verified proposals with such a node
        self.hits = {s: [0.0] * config.ngram for s in SOURCES}
        self.trials = {s: [0.0] * config.ngram for s in SOURCES}
        self.sources: list[str] = []  # per pending verification node: its source ...
        self.depths: list[int] = []  # ... and its depth (1: a child of the last token)
        self.window_nodes = 0  # lookahead rows pending after the verification nodes
        self.window_credit = 0  # accepted tokens of window-only n-grams in its last step

    def index_text(self, tokens: list[int], n: int) -> None:
        """The n-grams of the committed text not yet in the pool."""
        for start in range(max(self.indexed, 0), len(tokens) - n + 1):
            self.pool.add(tokens[start], tuple(tokens[start + 1:start + n]), "text")
        self.indexed = max(self.indexed, len(tokens) - n + 1)


class LookaheadPool:
    """Lookahead decoding's per-request pools and windows, and the measured value of the
    window's rows (shared by all requests)."""

    method = "lookahead"

    def __init__(self, config: LookaheadConfig) -> None:
        self.config = config
        self.width, self.n, self.g = config.window, config.ngram, config.max_candidates
        self._requests: dict[str, _Request] = {}
        # shared calibration per source (the window's guesses are right far less often than
        # the text's n-grams, and must not drag their chances down): as _Request's, decayed
        prior = [PRIOR_HITS[min(d, len(PRIOR_HITS) - 1)] * PRIOR_WEIGHT for d in range(self.n)]
        self.hits = {s: list(prior) for s in SOURCES}
        self.trials = {s: [PRIOR_WEIGHT] * self.n for s in SOURCES}
        # the window's n-grams: accepted tokens they brought, rows they took (decayed)
        self._value = [0.0, 0.0, 0.0]  # tokens, rows, window steps
        self._window_credit = _ProbeCredit(PROBE_SHARE)  # the window's probes
        self._pool_credit = _ProbeCredit(POOL_PROBE_SHARE)  # priced-out proposals' probes
        self.pool_probes = 0  # proposals verified as probes (counters)
        self.window_rows = 0  # lookahead rows run (counters)
        self.window_tokens = 0  # accepted tokens of n-grams only the window proposed

    @property
    def row_value(self) -> float:
        """Accepted tokens the window's n-grams brought per lookahead row over recent window
        steps, after a prior of PRIOR_ROW_VALUE over PRIOR_STEPS steps."""
        tokens, rows, _ = self._value
        prior_rows = PRIOR_STEPS * self.width * (self.n - 1)
        return (tokens + PRIOR_ROW_VALUE * prior_rows) / max(rows + prior_rows, 1e-9)

    def _request(self, seq: Sequence) -> _Request:
        req = self._requests.get(seq.request_id)
        if req is None:
            req = self._requests[seq.request_id] = _Request(self.config)
        return req

    def forget(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)

    # -- the verification branch ------------------------------------------------------------
    def propose(self, seq: Sequence, room: int, max_nodes: int) -> SuffixDraft:
        """The pool's continuations of the sequence's last token as a token tree of at most
        `max_nodes` nodes and `room` levels, nodes in order of their chance (so that the first
        k of them are a tree too)."""
        req = self._request(seq)
        tokens = seq.token_ids
        req.index_text(tokens, self.n)
        req.sources, req.depths = [], []
        depth = min(room, self.n - 1)
        if depth <= 0 or max_nodes <= 0:
            return SuffixDraft()
        candidates = req.pool.get(tokens[-1], self.g)
        if not candidates:
            return SuffixDraft()
        ids, parents, counts, sources, node_depth = [], [], [], [], []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for continuation, source in candidates:
            parent = ROOT
            for d, token in enumerate(continuation[:depth]):
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(ids)
                    ids.append(token)
                    parents.append(parent)
                    counts.append(0)
                    sources.append(source)
                    node_depth.append(d + 1)
                counts[node] += 1
                if source == "text":
                    sources[node] = "text"
                parent = node
        total = len(candidates)
        chance: list[float] = []  # a node's: no more than its parent's (a tree's order)
        for d, c, parent, source in zip(node_depth, counts, parents, sources):
            own = self._reach(req, source, d) * c / total
            chance.append(own if parent == ROOT else min(own, chance[parent]))
        kept = sorted(range(len(ids)), key=lambda j: (-chance[j], node_depth[j], j))[:max_nodes]
        where = {j: i for i, j in enumerate(kept)}  # (a parent sorts before its children)
        req.sources = [sources[j] for j in kept]
        req.depths = [node_depth[j] for j in kept]
        return SuffixDraft([ids[j] for j in kept], [chance[j] for j in kept], 0,
                           [ROOT if parents[j] == ROOT else where[parents[j]] for j in kept])

    def _reach(self, req: _Request, source: str, depth: int) -> float:
        """The calibrated chance that the accepted path reaches `depth` through a node of
        `source` where the proposal has one there: the request's own evidence over the shared
        rate (as a prior of PRIOR_WEIGHT)."""
        d = depth - 1
        shared = self.hits[source][d] / max(self.trials[source][d], 1e-9)
        return min((req.hits[source][d] + PRIOR_WEIGHT * shared)
                   / (req.trials[source][d] + PRIOR_WEIGHT), 1.0)

    def verified(self, seq: Sequence, num_nodes: int, accepted: int, path: list[int] | None
                 ) -> None:
        """The sequence verified the first `num_nodes` nodes of the pool's proposal and
        accepted `accepted` of them along `path` (None: a chain's first ones)."""
        req = self._request(seq)
        on_path = path if path is not None else list(range(accepted))
        proposed = set(zip(req.sources[:num_nodes], req.depths[:num_nodes]))
        for source, depth in proposed:  # (at most the pool's ngram - 1 levels deep)
            d = depth - 1
            reached = float(len(on_path) >= depth and on_path[d] < len(req.sources)
                            and req.sources[on_path[d]] == source)
            req.hits[source][d] += reached
            req.trials[source][d] += 1.0
            self.hits[source][d] = self.hits[source][d] * DECAY + reached
            self.trials[source][d] = self.trials[source][d] * DECAY + 1.0
        if on_path and on_path[-1] < len(req.sources) and req.sources[on_path[-1]] == "window":
            self.window_tokens += accepted
            req.window_credit = accepted
        req.sources, req.depths = [], []

    # -- the lookahead branch ---------------------------------------------------------------
    def window_pays(self, seq: Sequence, price: float) -> bool:
        """Whether the sequence runs its window's rows next step: where a row's measured value
        beats its price (accepted tokens a row must add), or to measure it: a probe, paid from
        the credit every call earns (PROBE_SHARE), at most one probe's worth saved up."""
        if self.width == 0:
            return False
        if self.row_value >= price:
            return True
        return self._window_credit.spend(self.width * (self.n - 1) * price)

    def probe(self, nodes: int, price: float) -> bool:
        """Whether a proposal of the pool that the plan priced out is verified anyway (its first
        `nodes` nodes, at `price` accepted tokens a row): where the credit every call earns
        (POOL_PROBE_SHARE) covers what its rows cost, at most one probe's worth saved up. Never
        where rows are not priced (0: the plan drafts whatever pays)."""
        if price <= 0.0 or nodes <= 0:
            return False
        if not self._pool_credit.spend(nodes * price):
            return False
        self.pool_probes += 1
        return True

    def window(self, seq: Sequence, first_node: int, max_nodes: int
               ) -> tuple[list[int], list[int]]:
        """The window's nodes as token-tree nodes after `first_node` verification nodes (ids,
        parents; level by level), aligned to the sequence's tokens; ([], []) where they do not
        fit in `max_nodes` (the request's window then restarts)."""
        req = self._request(seq)
        self._align(req, seq)
        levels = len(req.levels)
        if levels * self.width > max_nodes:
            req.levels, req.window_nodes = [], 0
            return [], []
        ids, parents = [], []
        for level, guesses in enumerate(req.levels):
            for i, token in enumerate(guesses):
                ids.append(token)
                if level == 0:
                    parents.append(ROOT if i == 0 else first_node + i - 1)
                else:
                    parents.append(first_node + (level - 1) * self.width + i)
        req.window_nodes = len(ids)
        return ids, parents

    def _align(self, req: _Request, seq: Sequence) -> None:
        """Slide the window to the sequence's last token: level l's token i guesses the token at
        index num_tokens + l + i (a new window starts from the pool's chain of guesses)."""
        n = seq.num_tokens
        shift = n - req.base
        if not req.levels or shift < 0 or shift >= self.width:
            req.levels, req.base = [self._guesses(req, seq, self.width)], n
            return
        if shift:
            for level, guesses in enumerate(req.levels):
                below = req.levels[level - 1] if level else None
                tail = [below[i + 1] if below is not None and i + 1 < len(below)
                        else guesses[-1] for i in range(self.width - shift, self.width)]
                req.levels[level] = guesses[shift:] + tail
            req.base = n

    def _guesses(self, req: _Request, seq: Sequence, count: int) -> list[int]:
        """A new window's first level: the pool's most recent chain from the last token, then
        the text's tokens after the last earlier occurrence of the last token (or itself)."""
        tokens = seq.token_ids
        out: list[int] = []
        key = tokens[-1]
        while len(out) < count:
            found = req.pool.get(key, 1)
            if not found:
                break
            out += found[0][0][:count - len(out)]
            key = out[-1]
        while len(out) < count:
            out.append(out[-1] if out else key)
        return out

    def stepped(self, seq: Sequence, window_nodes: int, outputs: list[int]) -> None:
        """The window's rows ran (`window_nodes` of them: all, else the window restarts) and
        the target's argmax at each is `outputs`. The last level's outputs become a new level;
        each full column enters the pool; the oldest level drops past ngram - 1 (the next
        `window` slides it to the committed tokens)."""
        req = self._request(seq)
        expected, req.window_nodes = req.window_nodes, 0
        gained, req.window_credit = req.window_credit, 0
        if expected and window_nodes == expected:
            self.window_rows += expected
            self._value = [v * VALUE_DECAY + x for v, x in zip(self._value,
                                                               (gained, expected, 1.0))]
        if not expected or window_nodes != expected or len(outputs) != expected:
            req.levels = []
            return
        levels = len(req.levels)
        req.levels.append(outputs[(levels - 1) * self.width:])
        if len(req.levels) == self.n:
            for i in range(self.width):
                req.pool.add(req.levels[0][i], tuple(level[i] for level in req.levels[1:]),
                             "window")
            req.levels.pop(0)
            req.base += 1
