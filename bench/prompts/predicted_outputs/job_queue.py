"""An in-process job queue: priorities, delayed jobs and retries with a dead-letter list."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class Job:
    run_at: float
    priority: int
    seq: int
    name: str = field(compare=False)
    payload: Any = field(compare=False, default=None)
    attempts: int = field(compare=False, default=0)


@dataclass
class Failure:
    job: Job
    error: str
    failed_at: float


class JobQueue:
    """Jobs run in order of due time, then priority (lower runs first), then submission."""

    def __init__(self, max_attempts: int = 3, retry_delay: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_attempts = max_attempts
        self.retry_delay = retry_delay
        self.clock = clock
        self._heap: list[Job] = []
        self._seq = itertools.count()
        self._handlers: dict[str, Callable[[Any], None]] = {}
        self.dead: list[Failure] = []
        self.done = 0

    def handler(self, name: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
        def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
            self._handlers[name] = fn
            return fn

        return register

    def submit(self, name: str, payload: Any = None, priority: int = 0,
               delay: float = 0.0) -> Job:
        if name not in self._handlers:
            raise KeyError(f"no handler for job {name!r}")
        job = Job(self.clock() + delay, priority, next(self._seq), name, payload)
        heapq.heappush(self._heap, job)
        return job

    def due(self) -> int:
        now = self.clock()
        return sum(1 for job in self._heap if job.run_at <= now)

    def run_once(self) -> bool:
        """Run the next due job, if any; False when nothing is due."""
        if not self._heap or self._heap[0].run_at > self.clock():
            return False
        job = heapq.heappop(self._heap)
        job.attempts += 1
        try:
            self._handlers[job.name](job.payload)
        except Exception as exc:  # noqa: BLE001 - every failure is retried or recorded
            if job.attempts > self.max_attempts:
                self.dead.append(Failure(job, repr(exc), self.clock()))
            else:
                job.run_at = self.clock() + self.retry_delay * job.attempts
                heapq.heappush(self._heap, job)
        else:
            self.done += 1
        return True

    def run_pending(self, limit: int | None = None) -> int:
        ran = 0
        while (limit is None or ran < limit) and self.run_once():
            ran += 1
        return ran

    def __len__(self) -> int:
        return len(self._heap)
