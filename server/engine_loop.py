"""The engine's side of the engine boundary: the loop that owns an LLMEngine, takes messages in
and sends messages out, in the server's process (a thread) or in an engine process of its own.

Every message is a tuple of plain picklable values, the same in both places:

in  ("add", request_id, prompt_ids, params, cache_salt) | ("abort", request_id)
    | ("abort_all",) | ("stop",)
out ("step", [StreamOutput], EngineStats)   after every step, and once a second when idle
    ("failed", [request_id], message)       a step raised: those requests are aborted
    ("rejected", request_id, message)       add_request refused it
    ("dead", message)                       the engine cannot go on; the loop has ended

Must not know about HTTP or asyncio.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from engine import LLMEngine, RequestOutput, StepError
from engine.engine_stats import snapshot

log = logging.getLogger("specserve.engine")

IDLE_PUBLISH_S = 1.0
# A test hook: the step whose target forward sees this token id raises (fault tests).
FAULT_TOKEN_ENV = "SPECSERVE_FAULT_ON_TOKEN"


@dataclass
class StreamOutput:
    """One request's progress in one step: only what is new, so a message stays small however
    long the request is."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list | None  # per new token (None unless the request asked for logprobs)
    num_output_tokens: int
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_methods: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, out: RequestOutput) -> StreamOutput:
        total, new = len(out.output_token_ids), out.new_token_ids
        logprobs = None if out.logprobs is None else out.logprobs[total - len(new):total]
        return cls(out.request_id, list(new), logprobs, total, len(out.prompt_token_ids),
                   out.finished, out.finish_reason, out.num_cached_tokens,
                   out.num_drafted_tokens, out.num_accepted_tokens, dict(out.spec_methods),
                   dict(out.metrics))


class EngineLoop:
    """Runs `engine`: `take(wait)` returns the messages that came in (blocking up to a second
    when `wait`), `send(message)` delivers one out."""

    def __init__(self, engine: LLMEngine, take, send) -> None:
        self.engine, self.take, self.send = engine, take, send
        self._requests: set[str] = set()  # in flight in the engine
        self._published = 0.0
        token = os.environ.get(FAULT_TOKEN_ENV)
        if token:
            _inject_fault(engine, int(token))

    def run(self) -> None:
        """Until a ("stop",) message, or until the engine cannot go on (a "dead" message)."""
        try:
            while True:
                for message in self.take(not self.engine.has_unfinished()):
                    if message[0] == "stop":
                        return
                    self._handle(message)
                if self.engine.has_unfinished():
                    self._step()
                elif time.monotonic() - self._published >= IDLE_PUBLISH_S:
                    workers = self.engine.workers  # a tensor-parallel rank may die while idle
                    problem = workers.problem() if workers is not None else None
                    if problem:
                        self.send(("dead", f"the engine cannot go on: {problem}"))
                        return
                    self._publish([])
        except StepError as exc:
            log.error("engine state lost after a failed step: %s", exc.__cause__)
            self.send(("dead", f"the engine failed: {exc.__cause__}"))
        except BaseException as exc:  # the loop itself failed
            log.exception("engine loop died")
            self.send(("dead", f"the engine loop stopped: {type(exc).__name__}: {exc}"))
        finally:
            self.engine.close()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, rid, prompt_ids, params, salt = message
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, cache_salt=salt)
            except ValueError as exc:  # validated before, but never take the loop down
                self.send(("rejected", rid, str(exc)))
                return
            self._requests.add(rid)
            return
        outputs = []
        for rid in (list(self._requests) if kind == "abort_all" else [message[1]]):
            self._requests.discard(rid)
            output = self.engine.abort(rid)
            if output is not None:
                outputs.append(output)
        if outputs:
            self._publish(outputs)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepError as exc:
            log.error("engine step failed (%s: %s); failing its %d request(s)",
                      type(exc.__cause__).__name__, exc.__cause__, len(exc.request_ids),
                      exc_info=exc.__cause__)
            self._requests.difference_update(exc.request_ids)
            self.send(("failed", exc.request_ids, str(exc.__cause__)))
            if not exc.intact:
                raise
            return
        for out in outputs:
            if out.finished:
                self._requests.discard(out.request_id)
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.send(("step", [StreamOutput.of(o) for o in outputs], snapshot(self.engine)))
        self._published = time.monotonic()


def _inject_fault(engine: LLMEngine, token: int) -> None:
    """Make every target forward over `token` raise inside the step (a test hook)."""
    execute = engine.runner.execute

    def failing(items, *args, **kw):
        if any(token in item.token_ids for item in items):
            raise RuntimeError(f"injected fault: token {token} in the step")
        return execute(items, *args, **kw)

    log.warning("%s is set: steps over token %d will fail", FAULT_TOKEN_ENV, token)
    engine.runner.execute = failing
