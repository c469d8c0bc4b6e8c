"""A small least-recently-used cache with hit statistics and optional size accounting."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    def __init__(self, max_items: int = 128, sizeof: Callable[[V], int] | None = None,
                 max_size: int | None = None) -> None:
        if max_items <= 0:
            raise ValueError("max_items must be positive")
        self.max_items = max_items
        self.sizeof = sizeof
        self.max_size = max_size
        self._data: OrderedDict[K, V] = OrderedDict()
        self._size = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V:
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            raise
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        if key in self._data:
            self._size -= self._measure(self._data.pop(key))
        self._data[key] = value
        self._size += self._measure(value)
        self._shrink()

    def pop(self, key: K) -> V:
        value = self._data.pop(key)
        self._size -= self._measure(value)
        return value

    def _measure(self, value: V) -> int:
        return self.sizeof(value) if self.sizeof is not None else 0

    def _shrink(self) -> None:
        while len(self._data) > self.max_items or (
                self.max_size is not None and self._size > self.max_size and len(self._data) > 1):
            _, oldest = self._data.popitem(last=False)
            self._size -= self._measure(oldest)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size(self) -> int:
        return self._size

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def clear(self) -> None:
        self._data.clear()
        self._size = 0


def memoize(max_items: int = 128) -> Callable[[Callable[..., V]], Callable[..., V]]:
    """Decorator: cache a function's results by its positional arguments."""

    def wrap(fn: Callable[..., V]) -> Callable[..., V]:
        cache: LRUCache[tuple, V] = LRUCache(max_items)

        def cached(*args):
            try:
                return cache.get(args)
            except KeyError:
                value = fn(*args)
                cache.put(args, value)
                return value

        cached.cache = cache  # type: ignore[attr-defined]
        cached.__name__ = fn.__name__
        cached.__doc__ = fn.__doc__
        return cached

    return wrap
