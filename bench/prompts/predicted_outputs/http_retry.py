"""Retry HTTP requests on transient failures with exponential backoff (urllib only)."""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RetryError(RuntimeError):
    def __init__(self, url: str, attempts: int, last: Exception) -> None:
        super().__init__(f"{url}: gave up after {attempts} attempts: {last}")
        self.url = url
        self.attempts = attempts
        self.last = last


def backoff_delays(base: float = 0.5, factor: float = 2.0, cap: float = 30.0,
                   attempts: int = 5) -> Iterator[float]:
    """The wait before each retry: base, base * factor, ... never more than cap, with full
    jitter (a random delay between 0 and that bound)."""
    bound = base
    for _ in range(attempts - 1):
        yield random.uniform(0, min(cap, bound))
        bound *= factor


def retry_after(error: urllib.error.HTTPError) -> float | None:
    """The server's Retry-After header in seconds, if it sent one as a number."""
    value = error.headers.get("Retry-After") if error.headers else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def is_transient(error: Exception) -> bool:
    if isinstance(error, urllib.error.HTTPError):
        return error.code in RETRY_STATUS
    return isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError))


def with_retries(call: Callable[[], Any], url: str, attempts: int = 5,
                 sleep: Callable[[float], None] = time.sleep) -> Any:
    delays = backoff_delays(attempts=attempts)
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as error:  # classified below
            if not is_transient(error) or attempt == attempts:
                if attempt == attempts and is_transient(error):
                    raise RetryError(url, attempt, error) from error
                raise
            delay = next(delays)
            if isinstance(error, urllib.error.HTTPError):
                delay = max(delay, retry_after(error) or 0.0)
            log.warning("%s: attempt %d failed (%s); retrying in %.2fs", url, attempt, error,
                        delay)
            sleep(delay)
    raise AssertionError("unreachable")


def get_json(url: str, timeout: float = 10.0, attempts: int = 5,
             headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json",
                                                   **(headers or {})})

    def call() -> Any:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode("utf-8"))

    return with_retries(call, url, attempts)


def post_json(url: str, body: Any, timeout: float = 10.0, attempts: int = 3) -> Any:
    data = json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})

    def call() -> Any:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
            return json.loads(payload) if payload else None

    return with_retries(call, url, attempts)
