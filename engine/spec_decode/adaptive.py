"""Choosing k per sequence per step from measured costs and running acceptance. No torch.

Model: a sequence with per-position acceptance a that verifies k drafts emits on average
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens. A step costs one target pass over all verified tokens,
C_t(num_tokens), plus K draft forwards over the drafting batch, K * C_d(batch). For each K in
0..k_max we predict tokens per second of the whole step and keep the best K; then each
sequence keeps only the draft positions j whose expected gain a^j beats the marginal cost of
verifying one more token at that rate. K = 0 (plain decoding) whenever speculation would not
pay, for example when the target pass is compute-bound at a large batch.

Costs are measured: `record_target` / `record_draft` feed exponential moving averages per
token-count (or batch-size) bucket; lookups interpolate between measured buckets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


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
class KController:
    k_max: int
    adaptive: bool = True
    draft_cost_free: bool = False  # n-gram: proposing costs (almost) nothing
    target_cost: CostTable = field(default_factory=CostTable)
    draft_cost: CostTable = field(default_factory=CostTable)
    prior_acceptance: float = 0.7  # global running estimate, updated as verifications come in
    prior_alpha: float = 0.05

    def record_verification(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            rate = num_accepted / (num_accepted + (num_accepted < num_drafted))
            self.prior_acceptance += self.prior_alpha * (rate - self.prior_acceptance)

    def choose(self, acceptance: list[float], other_tokens: int,
               backlog: list[int] | None = None,
               remaining: list[int] | None = None) -> list[int]:
        """k per drafting sequence.

        acceptance: per-position acceptance estimate of each sequence; other_tokens: tokens the
        next target pass computes for other sequences (prompt chunks); backlog: tokens each
        sequence's draft cache must catch up on before drafting (0 for a free proposer);
        remaining: tokens each sequence may still generate. Catching up is paid once and
        serves every later step, so its cost is spread over the remaining tokens.
        """
        n = len(acceptance)
        if not n or self.k_max == 0:
            return [0] * n
        if not self.adaptive or self.target_cost.empty:
            return [self.k_max] * n
        backlog = backlog if backlog is not None and not self.draft_cost_free else [0] * n
        remaining = remaining if remaining is not None else [1] * n
        base = other_tokens + n  # every decoding sequence verifies its last token anyway
        best_k, best_order = 0, []
        best_rate = n / max(self.target_cost(base), 1e-9)
        slope_t = max(self.target_cost(base + n) - self.target_cost(base), 0.0) / n
        slope_d = 0.0 if self.draft_cost_free else max(
            self.draft_cost(2 * n) - self.draft_cost(n), 0.0) / n
        for k in range(1, self.k_max + 1):
            gains = [expected_tokens(a, k) - 1.0 for a in acceptance]
            # this step's share of each catch-up: the tokens it emits over those still to come
            share = [b * min(1.0, (g + 1.0) / max(r, 1)) for b, g, r in
                     zip(backlog, gains, remaining)]
            # most extra tokens per second of verification and catch-up first
            order = sorted(range(n), key=lambda i: -gains[i] / (
                k * slope_t + share[i] * slope_d + 1e-9))
            tokens, catch_up = float(n), 0.0
            for m, i in enumerate(order, start=1):
                tokens += gains[i]
                catch_up += share[i]
                cost = self.target_cost(base + m * k) + self._draft_steps_cost(catch_up, m, k)
                rate = tokens / max(cost, 1e-9)
                if rate > best_rate:
                    best_k, best_order, best_rate = k, order[:m], rate
        ks = [0] * n
        if best_k == 0:
            return ks
        # Per sequence: keep draft position j only if a^j beats its marginal verification cost.
        threshold = slope_t * best_rate
        for i in best_order:
            a, k = acceptance[i], 0
            while k < best_k and a ** (k + 1) > threshold:
                k += 1
            ks[i] = k
        return ks

    def _draft_steps_cost(self, catch_up_tokens: float, batch: int, k: int) -> float:
        """First forward: every drafting sequence's backlog (at least 1 token each); then k - 1
        forwards of one token per sequence."""
        if self.draft_cost_free:
            return 0.0
        return (self.draft_cost(max(catch_up_tokens, batch))
                + (k - 1) * self.draft_cost(batch))
