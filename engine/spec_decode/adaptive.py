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


def expected_tokens(a: float, k: int) -> float:
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

    def choose(self, acceptance: list[float], other_tokens: int) -> list[int]:
        """k per drafting sequence, given their acceptance estimates and the step's other tokens."""
        n = len(acceptance)
        if not n or self.k_max == 0:
            return [0] * n
        if not self.adaptive or self.target_cost.empty:
            return [self.k_max] * n
        best_k, best_rate = 0, self._rate(acceptance, [0] * n, 0, other_tokens)
        for k in range(1, self.k_max + 1):
            rate = self._rate(acceptance, [k] * n, k, other_tokens)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            return [0] * n
        # Per sequence: keep draft position j only if a^j beats the marginal verification cost.
        tokens = other_tokens + n * (1 + best_k)
        marginal = max(self.target_cost(tokens + 1) - self.target_cost(tokens), 0.0)
        threshold = marginal * best_rate
        ks = []
        for a in acceptance:
            k = 0
            while k < best_k and a ** (k + 1) > threshold:
                k += 1
            ks.append(k)
        return ks

    def _rate(self, acceptance: list[float], ks: list[int], draft_steps: int,
              other_tokens: int) -> float:
        tokens = sum(expected_tokens(a, k) for a, k in zip(acceptance, ks))
        cost = self.target_cost(other_tokens + sum(1 + k for k in ks))
        if draft_steps and not self.draft_cost_free:
            cost += draft_steps * self.draft_cost(len(ks))
        return tokens / cost if cost > 0 else tokens
