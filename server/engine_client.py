"""EngineClient: the one boundary between the asyncio server and the engine.

The engine runs its step loop in a dedicated thread (torch releases the GIL in its kernels), so
the event loop stays responsive while a forward pass runs. Requests and aborts go in through a
thread-safe inbox; outputs come back through per-request asyncio queues
(`loop.call_soon_threadsafe`). Moving the engine into its own process later changes this class
and nothing else. Must not touch a `Sequence`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

from engine import LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger("specserve.engine")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


class EngineClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self.error: BaseException | None = None
        # event-loop side: requests submitted, and those submitted and not yet finished
        self.num_submitted = 0
        self.num_in_flight = 0
        self._finish_times: collections.deque[float] = collections.deque(maxlen=64)
        # engine-thread side, published after each step: submissions taken in, queue lengths
        self._num_taken = 0
        self.num_running = 0
        self.num_waiting = 0
        self.max_num_seqs = engine.scheduler.config.max_num_seqs
        self.step_listeners: list = []  # callables(engine, outputs) run in the engine thread

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- admission (event loop side) ---------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests that wait for a running slot at this moment, from this client's own counts.

        In flight beyond `max_num_seqs` wait; a burst first fills the free running slots, even
        before the engine thread has taken it in. Once the engine has a queue of its own (the KV
        pool, not the slots, is what binds), every request it has not taken in joins it."""
        beyond_slots = max(0, self.num_in_flight - self.max_num_seqs)
        if self.num_waiting:
            return max(beyond_slots, self.num_waiting + self.num_submitted - self._num_taken)
        return beyond_slots

    def drain_rate(self) -> float | None:
        """Requests finished per second lately (the last 64), or None before two finished."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

    def _finished(self) -> None:
        self.num_in_flight -= 1
        self._finish_times.append(time.monotonic())

    # -- requests (event loop side) ----------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               cache_salt: str | None = None) -> "RequestStream":
        """Queue a request now (it counts as in flight at once); iterate the result for outputs.

        `cache_salt`: the prefix-cache partition (the tenant) of the request."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.num_submitted += 1
        self.num_in_flight += 1
        self._inbox.put(("add", request_id, prompt_ids, params, cache_salt, stream))
        self._wake.set()
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        self._inbox.put(("abort_all",))
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as exc:  # the loop itself failed: report and fail every request
            log.exception("engine loop died")
            self.error = exc
            for stream in self._streams.values():
                stream.put(EngineDeadError("the engine loop stopped"))
            self._streams.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt_ids, params, cache_salt, stream = msg
                self._num_taken += 1
                try:
                    self.engine.add_request(prompt_ids, params, request_id=rid,
                                            cache_salt=cache_salt)
                except ValueError as exc:  # validated before, but never take the loop down
                    stream.put(exc)
                    continue
                self._streams[rid] = stream
            else:
                for rid in (list(self._streams) if msg[0] == "abort_all" else [msg[1]]):
                    output = self.engine.abort(rid)
                    stream = self._streams.pop(rid, None)
                    if output is not None and stream is not None:
                        stream.put(output)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failing step fails its requests, not the server
            log.exception("engine step failed; aborting the requests in flight")
            for rid, stream in list(self._streams.items()):
                self.engine.abort(rid)
                stream.put(RuntimeError("the engine failed while serving this request"))
            self._streams.clear()
            del exc
            return
        # one wake-up of the event loop per step, not one per request
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
            if out.finished:
                self._streams.pop(out.request_id, None)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput] = ()) -> None:
        self.num_running = self.engine.num_running
        self.num_waiting = self.engine.num_waiting
        for listener in self.step_listeners:
            listener(self.engine, outputs)


def _deliver(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class RequestStream:
    """One request's outputs, step by step. Closing it early aborts the request in the engine."""

    def __init__(self, client: EngineClient, request_id: str, stream: _Stream) -> None:
        self.client, self.request_id, self._stream = client, request_id, stream
        self.finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):  # the engine never took it, or the loop died
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client._finished()
        if not self.finished:
            self.client.abort(self.request_id)

    def __del__(self) -> None:  # never leak a request whose consumer vanished
        self.close()
