"""A token-bucket rate limiter for outgoing API calls, one bucket per key."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """Holds up to `capacity` tokens, refilled at `rate` tokens per second."""

    capacity: float
    rate: float
    tokens: float = field(default=-1.0)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.rate <= 0:
            raise ValueError("capacity and rate must be positive")
        if self.tokens < 0:
            self.tokens = self.capacity

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_take(self, amount: float = 1.0, now: float | None = None) -> bool:
        """Take `amount` tokens if the bucket holds them; never blocks."""
        self._refill(time.monotonic() if now is None else now)
        if self.tokens >= amount:
            self.tokens -= amount
            return True
        return False

    def wait_time(self, amount: float = 1.0, now: float | None = None) -> float:
        """Seconds until `amount` tokens will be available (0 if they are now)."""
        self._refill(time.monotonic() if now is None else now)
        missing = amount - self.tokens
        return 0.0 if missing <= 0 else missing / self.rate


class KeyedLimiter:
    """One TokenBucket per key (an API key, a host), created on first use."""

    def __init__(self, capacity: float, rate: float, max_keys: int = 10_000) -> None:
        self.capacity = capacity
        self.rate = rate
        self.max_keys = max_keys
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def bucket(self, key: str) -> TokenBucket:
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= self.max_keys:
                    self._evict_full()
                bucket = TokenBucket(self.capacity, self.rate)
                self._buckets[key] = bucket
            return bucket

    def _evict_full(self) -> None:
        """Drop the buckets that have refilled completely: they hold no state worth keeping."""
        now = time.monotonic()
        for key in list(self._buckets):
            bucket = self._buckets[key]
            bucket._refill(now)
            if bucket.tokens >= bucket.capacity:
                del self._buckets[key]

    def allow(self, key: str, amount: float = 1.0) -> bool:
        bucket = self.bucket(key)
        with self._lock:
            return bucket.try_take(amount)

    def acquire(self, key: str, amount: float = 1.0, timeout: float | None = None) -> bool:
        """Block until `amount` tokens are taken for `key`, or until `timeout` seconds pass."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bucket = self.bucket(key)
        while True:
            with self._lock:
                if bucket.try_take(amount):
                    return True
                delay = bucket.wait_time(amount)
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            time.sleep(delay)

    def __len__(self) -> int:
        return len(self._buckets)
