"""Choosing k per sequence per step from measured costs and running acceptance. No torch.

Model: a sequence with per-position acceptance a that verifies k drafts emits on average
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens. A step costs one target pass over all verified tokens,
C_t(num_tokens), plus K draft forwards over the drafting batch, K * C_d(batch). For each K in
0..k_max we predict tokens per second of the whole step and keep the best K; then each
sequence keeps only the draft positions j whose expected gain a^j beats the marginal cost of
verifying one more token at that rate (the cost table's slope over all the tokens a plan may
add, so that one noisy entry cannot decide it). K = 0 (plain decoding) whenever speculation would not
pay, for example when the target pass is compute-bound at a large batch.

Costs are measured: the engine records every target pass and draft forward into exponential
moving averages per token count; lookups interpolate between measured sizes. Predictions are
checked against what happens: the accepted tokens verification actually returns, over those the
acceptance model predicted, scale the predicted gains (`gain_scale`), and speculation must beat
plain decoding by a margin (`min_gain`) so that noise in the cost tables does not turn it on
where it does not pay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, NamedTuple


class CostTable:
    """Seconds as a function of size, from measurements (EMA per size, linear interpolation)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.sizes: list[int] = []
        self.seconds: list[float] = []

    def record(self, size: int, seconds: float) -> None:
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            self.seconds[i] += self.alpha * (seconds - self.seconds[i])
        else:
            self.sizes.insert(i, size)
            self.seconds.insert(i, seconds)

    @property
    def empty(self) -> bool:
        return not self.sizes

    def __call__(self, size: float) -> float:
        xs, ys = self.sizes, self.seconds
        if not xs:
            return 0.0
        if size <= xs[0] or len(xs) == 1:
            return ys[0] if size <= xs[0] else ys[0] * size / xs[0]
        i = min(bisect.bisect_left(xs, size), len(xs) - 1)  # beyond the last: extrapolate
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (size - x0) / (x1 - x0), 0.0)


@dataclass
class ForwardCost:
    """Seconds of one forward pass: `table(tokens) + per_seq * (sequences - 1)`.

    A pass over many sequences pays per-sequence attention work that one sequence of as many
    tokens does not, and verifying drafts adds tokens, not sequences; so the table is kept by
    tokens (one sequence) and the per-sequence part apart.
    """

    table: CostTable = field(default_factory=CostTable)
    per_seq: float = 0.0

    def record(self, tokens: int, seqs: int, seconds: float) -> None:
        extra = self.per_seq * max(seqs - 1, 0)
        self.table.record(tokens, max(seconds - extra, 0.1 * seconds))

    def __call__(self, tokens: float, seqs: int = 1) -> float:
        return self.table(tokens) + self.per_seq * max(seqs - 1, 0)

    def slope(self, tokens: int, extra: int) -> float:
        """Marginal seconds per token of adding `extra` tokens to a pass of `tokens`."""
        return max(self.table(tokens + extra) - self.table(tokens), 0.0) / extra

    @property
    def empty(self) -> bool:
        return self.table.empty


class Plan(NamedTuple):
    """The best way to run one step: `k` drafts (0: plain) for the sequences in `order`."""

    k: int
    order: list[int]  # indices of the drafting sequences, most gain per cost first
    rate: float  # predicted tokens per second of the step
    target_slope: float  # the target's marginal seconds per verified token


def expected_tokens(a: float, k: float) -> float:
    """Tokens emitted by one verification of k drafts at per-position acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AcceptanceStats:
    """Per-position acceptance estimate: accepted / (accepted + rejections), with a prior."""

    accepted: int = 0
    rejections: int = 0

    def estimate(self, prior: float, weight: float = 4.0) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejections + weight)


@dataclass
class RealizedRates:
    """Tokens per second that decode steps actually reached, per batch-size class (n's bit
    length: 1, 2-3, 4-7, 8-15, ...), with and without speculation: the check on the cost model.

    The plans are predictions from cost tables kept by token count; at larger batches the
    packaged pair realized up to 15% less than predicted (per-row sampling and verification work
    the tables see only on average), so speculation could run slower than plain decoding. A
    rate is the class's decayed sum of tokens over its decayed sum of seconds (a slow step
    weighs by its time, not as one step among others); a speculative step's seconds are its
    whole cost: the step from scheduling to committing its tokens, with its verification,
    keyed draws and grammar masks, plus the proposal it verified (draft forwards, the draft
    batch's own overhead, suffix lookups). What a steady run does not pay is kept out and
    judged apart: a long catch-up of the draft model (a prompt, or tokens emitted by plain
    steps) serves every later step, so it is an investment `pays_back` weighs against what
    speculation saves (see guard.py `Guard._invest`).

    `decide` answers per step. Speculation runs ("speculate") until the class has both rates
    and speculation's is the lower, with one plain step in `refresh_every` to keep the plain
    rate current, and one in `measure_plain_every` while the class has no plain rate yet (for
    its first `measure_plain_for` decisions: a new batch size cannot run a losing speculation
    for long before there is a plain rate to compare with). Where it lost, steps run "plain",
    with a burst of `explore_burst` "explore" steps at the end of every period to notice when
    that changes; a burst forgets most of the old speculative evidence (`explore_forget`) so
    that its own steps decide, and each burst whose speculative steps find speculation still
    slower doubles the period (`explore_every` up to `max_explore_every`): exploring a losing
    speculation costs less and less. A rate needs `min_steps` steps (`min_spec_steps` speculative ones: a few
    steps that kept none of their drafts must not decide); with `decay` per step of its mode,
    a collapse shows within a few steps.
    """

    decay: float = 0.85
    min_steps: int = 4
    min_spec_steps: int = 12
    explore_every: int = 16
    max_explore_every: int = 256
    explore_burst: int = 3
    explore_forget: float = 0.3
    refresh_every: int = 32
    measure_plain_every: int = 4
    measure_plain_for: int = 32
    _sums: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    _asked: dict[int, int] = field(default_factory=dict)
    _off: dict[int, list[int]] = field(default_factory=dict)  # classes where it lost

    def record(self, seqs: int, speculative: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0.0 or tokens <= 0:
            return
        sums = self._sums.setdefault((seqs.bit_length(), speculative), [0.0, 0.0, 0])
        sums[0] = sums[0] * self.decay + tokens
        sums[1] = sums[1] * self.decay + seconds
        sums[2] += 1

    def rate(self, seqs: int, speculative: bool) -> float | None:
        """Realized tokens per second of the class of `seqs` (None: too few steps yet)."""
        sums = self._sums.get((seqs.bit_length(), speculative))
        if sums is None or sums[2] < (self.min_spec_steps if speculative else self.min_steps):
            return None
        return sums[0] / sums[1]

    def decide(self, seqs: int) -> str:
        """"speculate", "explore" or "plain", for the next step of `seqs` sequences with some
        to draft for (each call counts as one such step; the plan then chooses the drafts)."""
        c = seqs.bit_length()
        asked = self._asked[c] = self._asked.get(c, 0) + 1
        spec, plain = self.rate(seqs, True), self.rate(seqs, False)
        if plain is None and asked <= self.measure_plain_for:
            return "plain" if asked % self.measure_plain_every == 0 else "speculate"
        if spec is None or plain is None or spec >= plain:
            self._off.pop(c, None)
            return "plain" if asked % self.refresh_every == 0 else "speculate"
        # [decision in the period, period, speculative steps when its burst began]
        off = self._off.setdefault(c, [0, self.explore_every, 0])
        sums = self._sums[c, True]
        off[0] += 1
        if off[0] > off[1]:  # a burst ended and speculation is still slower
            learned = sums[2] > off[2]  # (a burst may have run no speculative step)
            off[0], off[1] = 1, min(2 * off[1], self.max_explore_every) if learned else off[1]
        first = off[1] - self.explore_burst + 1  # the burst: the period's last decisions
        if off[0] == first:  # its own steps decide
            sums[0] *= self.explore_forget
            sums[1] *= self.explore_forget
            off[2] = sums[2]
        return "explore" if off[0] >= first else "plain"

    def saving(self, seqs: int) -> float | None:
        """Seconds speculation saved per token emitted at this batch size, realized (negative
        where it lost; None until both rates are known)."""
        spec, plain = self.rate(seqs, True), self.rate(seqs, False)
        if spec is None or plain is None:
            return None
        return 1.0 / plain - 1.0 / spec

    def pays_back(self, seqs: int, remaining: float, seconds: float) -> bool | None:
        """Whether catching a draft up for `seconds` pays back over the `remaining` tokens a
        sequence is expected to emit, at the saving realized at this batch size (None: no
        realized saving yet, the plan's prediction decides)."""
        saving = self.saving(seqs)
        return None if saving is None else remaining * saving > seconds


@dataclass
class KController:
    k_max: int
    adaptive: bool = True
    draft_cost_free: bool = False  # n-gram: proposing costs (almost) nothing
    target_cost: ForwardCost = field(default_factory=ForwardCost)  # one target pass
    draft_cost: ForwardCost = field(default_factory=ForwardCost)  # one draft forward
    initial_acceptance: float = 0.7  # assumed before any verification
    min_gain: float = 0.03  # speculate only when the predicted rate beats plain by this much,
    min_gain_per_seq: float = 0.01  # ... plus this per decoding sequence after the first
    max_min_gain: float = 0.12  # (a batch's step costs are predicted less well: see margin)
    invest_min_gain: float = 0.10  # ... and catch up a long backlog only for a win this clear
    feedback_decay: float = 0.99  # per verification, for the prior and the realized-gain scale
    _prior_counts: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _gain_sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # realized, predicted

    @property
    def prior_acceptance(self) -> float:
        """Acceptance of a sequence with no history yet: that of recent drafts."""
        return AcceptanceStats(*self._prior_counts).estimate(self.initial_acceptance)

    @property
    def gain_scale(self) -> float:
        """Accepted tokens realized / predicted by the acceptance model, over recent drafts.

        The geometric model with one acceptance per sequence is biased (acceptance depends on
        the position, and choosing the sequences with the best estimates selects optimistic
        ones); scaling the predicted gains by what verification actually returned corrects it.
        """
        realized, predicted = self._gain_sums
        if predicted < 8.0:  # not enough evidence yet
            return 1.0
        return min(max(realized / predicted, 0.5), 1.5)

    def record_verification(self, num_drafted: int, num_accepted: int,
                            predicted_accepted: float | None = None) -> None:
        """One sequence's verification; `predicted_accepted` is what `choose` expected of it
        (before the realized-gain scale)."""
        if not num_drafted:
            return
        self.decay_evidence()
        self._prior_counts[0] += num_accepted
        self._prior_counts[1] += num_accepted < num_drafted
        if predicted_accepted is not None:
            self._gain_sums[0] += num_accepted
            self._gain_sums[1] += predicted_accepted

    def decay_evidence(self) -> None:
        """Decay the evidence: per verification, and (called by the guard) per step
        without drafts, so a prior or gain scale that turned speculation off cannot keep it off
        forever."""
        d = self.feedback_decay
        self._prior_counts = [x * d for x in self._prior_counts]
        self._gain_sums = [x * d for x in self._gain_sums]

    def choose(self, acceptance: list[float], other_tokens: int,
               backlog: list[int] | None = None,
               remaining: list[int] | None = None, pending: int = 0,
               other_seqs: int = 0) -> list[int]:
        """k per drafting sequence. Reads the controller's state, changes nothing.

        acceptance: per-position acceptance estimate of each sequence; other_tokens: tokens the
        next target pass computes for other sequences (prompt chunks); backlog: tokens each
        sequence's draft cache must catch up on before drafting (0 for a free proposer);
        remaining: tokens each sequence may still generate; pending: sequences that will join
        the decoding batch soon (prompts being computed or waiting); other_seqs: sequences in
        the next target pass besides these (prompt chunks).

        Every drafting step catches the draft cache up on the tokens the previous step emitted:
        that part of the backlog is a cost of this step. A longer backlog (a prompt, tokens
        emitted while k was 0) is paid once and serves every later step, so its cost is spread
        over the remaining tokens, but only for sequences that speculation pays for once
        caught up (the steady state, without prompt chunks in the pass); otherwise this step
        pays all of it. Catching up is an investment that pays back only while speculation keeps
        winning, so it needs a clear steady-state win (`invest_min_gain`), not a marginal one.
        """
        n = len(acceptance)
        if not n or self.k_max == 0:
            return [0] * n
        if not self.adaptive or self.target_cost.empty:
            return [self.k_max] * n
        scale = self.gain_scale
        charge = self._catch_up_charge(acceptance, backlog, remaining, pending, scale)
        plan = self._plan(acceptance, other_tokens + n, charge, self.margin(n), n + other_seqs,
                          scale, self._chunks_cost(other_tokens + n, n + other_seqs, n))
        # Per sequence: keep draft position j only if its expected gain beats its marginal
        # verification cost at the chosen rate.
        threshold = plan.target_slope * plan.rate
        ks = [0] * n
        for i in plan.order:
            a, k = acceptance[i], 0
            while k < plan.k and scale * a ** (k + 1) > threshold:
                k += 1
            ks[i] = k
        return ks

    def _catch_up_charge(self, acceptance: list[float], backlog: list[int] | None,
                         remaining: list[int] | None, pending: int,
                         scale: float) -> Callable[[int, float], float]:
        """charge(i, gain): draft tokens sequence i's catch-up costs this step, if it drafts
        and is expected to emit gain + 1 tokens (see `choose`)."""
        n = len(acceptance)
        if self.draft_cost_free or backlog is None:
            return lambda i, gain: 0.0
        remaining = remaining if remaining is not None else [1] * n
        # which sequences may spread a long catch-up: those that win once caught up
        steady_acceptance = acceptance + [self.prior_acceptance] * pending
        steady = self._plan(steady_acceptance, len(steady_acceptance),
                            lambda i, gain: gain + 1.0, self.invest_min_gain,
                            len(steady_acceptance), scale)
        amortized = {i for i in steady.order if i < n}

        def charge(i: int, gain: float) -> float:
            emitted = gain + 1.0
            excess = max(backlog[i] - emitted, 0.0)
            share = min(1.0, emitted / max(remaining[i], 1)) if i in amortized else 1.0
            return min(backlog[i], emitted) + excess * share

        return charge

    def choose_hybrid(self, acceptance: list[float], free: list[list[float]],
                      other_tokens: int, backlog: list[int] | None = None,
                      remaining: list[int] | None = None, pending: int = 0,
                      other_seqs: int = 0, draft: bool = True) -> tuple[list[int], list[int]]:
        """(draft k, free k) per sequence, at most one of the two nonzero: each sequence takes
        its free proposal (a suffix match: no draft forward) or the draft model's, or none,
        whichever plan predicts the most tokens per second for the whole step.

        free[i]: the confidences of sequence i's free proposal, per position j the predicted
        chance that its drafts 1..j are all accepted (non-increasing). `acceptance` and the
        rest are as in `choose`, for the draft model; draft=False: no draft model.
        """
        n = len(free)
        k_max = self.k_max if draft else 0
        if not n:
            return [], []
        if not self.adaptive or self.target_cost.empty:
            kf = [len(c) for c in free]
            return [0 if f else k_max for f in kf], kf
        scale = self.gain_scale
        charge = (self._catch_up_charge(acceptance, backlog, remaining, pending, scale)
                  if k_max else (lambda i, gain: 0.0))
        base, seqs = other_tokens + n, n + other_seqs
        chunks = self._chunks_cost(base, seqs, n)
        plain = n / max(self.target_cost(base, seqs) - chunks, 1e-9)
        # over every token a plan may add: one noisy size must not decide the marginal cost
        slope_t = self.target_cost.slope(base, max(n * k_max, sum(map(len, free)), n))

        def free_lengths(rate: float) -> list[int]:
            # keep position j while its chance beats the cost of verifying it at this rate
            return [sum(c > slope_t * rate for c in conf) for conf in free]

        lengths = free_lengths(plain)
        gains = [sum(conf[:m]) for conf, m in zip(free, lengths)]
        rate = (n + sum(gains)) / max(self.target_cost(base + sum(lengths), seqs) - chunks,
                                      1e-9)
        if rate > plain:  # stricter lengths at the rate the free proposals reach
            lengths = free_lengths(rate)
            gains = [sum(conf[:m]) for conf, m in zip(free, lengths)]
        best_rate, best_kd, best_kf = plain * (1.0 + self.margin(n)), [0] * n, [0] * n
        free_tokens, free_gain = sum(lengths), sum(gains)
        rate = (n + free_gain) / max(self.target_cost(base + free_tokens, seqs) - chunks, 1e-9)
        if rate > best_rate:
            best_rate, best_kf = rate, list(lengths)
        for k in range(1, k_max + 1):
            best_rate, best_kd, best_kf = self._with_draft_k(
                k, acceptance, lengths, gains, charge, base, seqs, chunks,
                (best_rate, best_kd, best_kf))
        return self._trim(best_kd, acceptance, slope_t * best_rate), best_kf

    def _with_draft_k(self, k: int, acceptance: list[float], lengths: list[int],
                      gains: list[float], charge, base: int, seqs: int, chunks: float,
                      best: tuple[float, list[int], list[int]]
                      ) -> tuple[float, list[int], list[int]]:
        """`best` (rate, draft k, free k), or a better plan where some sequences take the draft
        model's k instead of their free proposal (`lengths` of predicted `gains`): those it
        gains most on first."""
        best_rate, best_kd, best_kf = best
        n, scale = len(acceptance), self.gain_scale
        dgain = [scale * self.predicted_accepted(a, k) for a in acceptance]
        better = sorted((i for i in range(n) if dgain[i] > gains[i]),
                        key=lambda i: gains[i] - dgain[i])
        tokens, verified, catch_up = float(n + sum(gains)), base + sum(lengths), 0.0
        for m, i in enumerate(better, start=1):
            tokens += dgain[i] - gains[i]
            verified += k - lengths[i]
            catch_up += charge(i, dgain[i])
            cost = (self.target_cost(verified, seqs) - chunks
                    + self._draft_steps_cost(catch_up, m, k))
            rate = tokens / max(cost, 1e-9)
            if rate > best_rate:
                chosen = set(better[:m])
                best_rate = rate
                best_kd = [k if i in chosen else 0 for i in range(n)]
                best_kf = [0 if i in chosen else lengths[i] for i in range(n)]
        return best_rate, best_kd, best_kf

    def tree_prices(self, acceptance: list[float], ks: list[int], other_tokens: int,
                    other_seqs: int, width: int) -> tuple[float, float]:
        """What a drafting sequence's token tree must pay for, at the tokens per second the
        chosen ks predict: (1) the chance of acceptance a node needs for its row, the target's
        marginal seconds per verified token times that rate (as `choose` keeps a chain's
        positions); (2) the accepted tokens one more level must be expected to add for its
        draft forward (`width` rows per drafting sequence; its share of the batch's forward).
        0 before a cost is measured (then a tree takes every node its limit allows) and, for
        the level, for a free proposer."""
        rate = self._chosen_rate(acceptance, ks, other_tokens, other_seqs)
        if rate is None:
            return 0.0, 0.0
        n, m = len(acceptance), sum(k > 0 for k in ks)
        node = self.target_cost.slope(other_tokens + n, max(n * self.k_max, n)) * rate
        if not m or self.draft_cost_free or self.draft_cost.empty:
            return node, 0.0
        return node, rate * self.draft_cost(width * m, m) / m

    def _chosen_rate(self, acceptance: list[float], ks: list[int], other_tokens: int,
                     other_seqs: int) -> float | None:
        """Tokens per second the chosen ks predict for the target pass (None: unmeasured)."""
        n = len(acceptance)
        if not n or not self.adaptive or self.target_cost.empty:
            return None
        base, seqs = other_tokens + n, n + other_seqs
        chunks = self._chunks_cost(base, seqs, n)
        tokens = n + sum(self.gain_scale * self.predicted_accepted(a, k)
                         for a, k in zip(acceptance, ks))
        return tokens / max(self.target_cost(base + sum(ks), seqs) - chunks, 1e-9)

    def _trim(self, ks: list[int], acceptance: list[float], threshold: float) -> list[int]:
        """A drafting sequence keeps position j only where its gain beats its verification
        cost (`threshold`, at the plan's rate)."""
        trimmed = []
        for a, k in zip(acceptance, ks):
            j = 0
            while j < k and self.gain_scale * a ** (j + 1) > threshold:
                j += 1
            trimmed.append(j)
        return trimmed

    def margin(self, n: int) -> float:
        """How much a speculative plan for n decoding sequences must beat plain decoding by.
        It grows with n: measured on the packaged pair, batches of 8 realized up to 10% less
        than predicted (per-row sampling and verification work the token-count cost tables
        see only on average), while one sequence's predictions held."""
        return min(self.min_gain + self.min_gain_per_seq * max(n - 1, 0), self.max_min_gain)

    def predicted_accepted(self, acceptance: float, k: int) -> float:
        """Accepted tokens the acceptance model expects of k drafts (no realized-gain scale)."""
        return expected_tokens(acceptance, k) - 1.0

    def _plan(self, acceptance: list[float], base: int,
              charge: Callable[[int, float], float], margin: float, seqs: int,
              scale: float, chunks: float = 0.0) -> Plan:
        """The K (and the sequences that draft) with the most tokens per second for one step.

        base: tokens in the target pass without drafts; charge(i, gain): draft tokens sequence
        i's catch-up costs this step; seqs: sequences in the target pass; scale: the realized
        gain scale; chunks: the seconds of the pass that its prompt chunks cost (`_chunks_cost`:
        not charged to the decoding tokens). K = 0 unless a plan beats plain decoding by
        `margin`.
        """
        n = len(acceptance)
        plain_rate = n / max(self.target_cost(base, seqs) - chunks, 1e-9)
        # over every token a plan may add: one noisy size must not decide the marginal cost
        slope_t = self.target_cost.slope(base, n * self.k_max)
        best = Plan(0, [], plain_rate * (1.0 + margin), slope_t)
        slope_d = 0.0 if self.draft_cost_free else self.draft_cost.slope(n, n)
        for k in range(1, self.k_max + 1):
            gains = [scale * self.predicted_accepted(a, k) for a in acceptance]
            charges = [charge(i, g) for i, g in enumerate(gains)]
            # most extra tokens per second of verification and catch-up first
            order = sorted(range(n), key=lambda i: -gains[i] / (
                k * slope_t + charges[i] * slope_d + 1e-9))
            tokens, catch_up = float(n), 0.0
            for m, i in enumerate(order, start=1):
                tokens += gains[i]
                catch_up += charges[i]
                cost = (self.target_cost(base + m * k, seqs) - chunks
                        + self._draft_steps_cost(catch_up, m, k))
                rate = tokens / max(cost, 1e-9)
                if rate > best.rate:
                    best = Plan(k, order[:m], rate, slope_t)
        return best

    def _chunks_cost(self, base: int, seqs: int, n: int) -> float:
        """Seconds of a target pass of `base` tokens over `seqs` sequences that go to its
        prompt chunks rather than to its `n` decoding sequences (0 in a pure decode step).

        Drafts are worth the decode steps they save, at what a decode step of these sequences
        costs per token; a pass that also computes a prompt chunk is far slower, and charging
        the chunk to the decoding tokens made a draft's verification look cheap beside it
        (drafts of any confidence were kept in such passes, each row at the chunk's marginal
        cost)."""
        if base <= n and seqs <= n:
            return 0.0
        return max(self.target_cost(base, seqs) - self.target_cost(n, n), 0.0)

    def _draft_steps_cost(self, catch_up_tokens: float, batch: int, k: int) -> float:
        """First forward: every drafting sequence's catch-up (at least 1 token each); then
        k - 1 forwards of one token per sequence."""
        if self.draft_cost_free:
            return 0.0
        return (self.draft_cost(max(catch_up_tokens, batch), batch)
                + (k - 1) * self.draft_cost(batch, batch))
