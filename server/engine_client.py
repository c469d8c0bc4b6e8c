"""EngineClient: the one boundary between the asyncio server and the engine.

The engine runs in an `EngineLoop` (server/engine_loop.py), either in a thread of this process
(`in_thread`: torch releases the GIL in its kernels, so the event loop stays responsive while a
forward runs) or in an engine process of its own (`in_process`, `server.engine_process`: HTTP,
tokenization and detokenization then never compete with the step for the GIL). The two differ
only in how messages travel (a queue, or a pipe); the server sees the same client: `submit`
gives a RequestStream of StreamOutputs, `validate` answers before submitting, `info` says what
is served, and listeners get each step's EngineStats snapshot with its outputs.

A failed step fails its requests (their streams raise EngineStepError); an engine that cannot go
on, or an engine process that died, fails every request at once (EngineDeadError) and `alive`
turns false. Must not touch a `Sequence` or an LLMEngine's insides.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass

from engine import SamplingParams
from engine.engine_stats import EngineInfo, EngineStats
from engine.request_check import check_request
from server.engine_loop import EngineLoop, StreamOutput

log = logging.getLogger("specserve.engine")


class EngineDeadError(RuntimeError):
    """The engine stopped: no request in flight will finish."""


class EngineLoadError(RuntimeError):
    """The engine process could not load the engine; the message is its one-line reason."""


class EngineStepError(RuntimeError):
    """A step with this request in it raised; the engine goes on with the others."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineClient:
    def __init__(self, transport, info: EngineInfo, validate,
                 stats: EngineStats | None = None) -> None:
        self._transport, self.info, self._validate = transport, info, validate
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # _streams: the event loop adds, the receiver removes
        self.error: str | None = None  # why the engine stopped
        self._shut_down = False
        # event-loop side: requests submitted, and those submitted and not yet finished
        self.num_submitted = 0
        self.num_in_flight = 0
        self._finish_times: collections.deque[float] = collections.deque(maxlen=64)
        self.stats = stats or EngineStats()  # the latest snapshot
        self.step_listeners: list = []  # callables(EngineStats, outputs), receiver thread

    @classmethod
    def in_thread(cls, engine) -> EngineClient:
        """Run `engine` (an LLMEngine) in a thread of this process."""
        from engine.engine_stats import describe, snapshot

        return cls(_ThreadTransport(engine), describe(engine), engine.validate,
                   snapshot(engine))

    @classmethod
    def in_process(cls, engine_config, tokenizer) -> EngineClient:
        """Build the engine of `engine_config` in a process of its own (blocks until it is
        loaded; raises EngineLoadError with the engine's one-line reason if it cannot be).
        `tokenizer`: this process's copy, for checking grammars."""
        transport = _ProcessTransport(engine_config)
        info = transport.info
        holder: list = []

        def grammars():
            if not holder:
                from engine.structured import Grammars

                holder.append(Grammars(tokenizer, info.vocab_size, set(info.eos_token_ids)))
            return holder[0]

        def validate(prompt_ids, params):
            check_request(prompt_ids, params, info.vocab_size, info.max_model_len, grammars)

        return cls(transport, info, validate, transport.stats)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._transport.start(self._receive)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._shut_down = True
        self._transport.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self._transport.running

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving when nobody shut it down, or None."""
        if self.error is None and not self._shut_down and not self._transport.running:
            return "the engine stopped"
        return self.error

    # -- admission (event loop side) ---------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the field) for what the engine cannot run."""
        self._validate(prompt_ids, params)

    @property
    def num_queued(self) -> int:
        """Requests that wait for a running slot at this moment, from this client's own counts.

        In flight beyond `max_num_seqs` wait; a burst first fills the free running slots, even
        before the engine has taken it in. Once the engine has a queue of its own (the KV
        pool, not the slots, is what binds), every request not yet running joins it."""
        beyond_slots = max(0, self.num_in_flight - self.info.max_num_seqs)
        if self.stats.num_waiting:
            return max(beyond_slots, self.num_in_flight - self.stats.num_running)
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
               cache_salt: str | None = None) -> RequestStream:
        """Queue a request now (it counts as in flight at once); iterate the result for outputs.

        `cache_salt`: the prefix-cache partition (the tenant) of the request."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request_id] = stream
        self.num_submitted += 1
        self.num_in_flight += 1
        self._transport.send(("add", request_id, list(prompt_ids), params, cache_salt))
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._transport.send(("abort", request_id))

    def abort_all(self) -> None:
        if self.alive:
            self._transport.send(("abort_all",))

    # -- the receiver (the engine thread, or the thread reading the engine process) ----------
    def _receive(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, stats = message
            self.stats = stats
            self._deliver([(out.request_id, out, out.finished) for out in outputs])
            for listener in self.step_listeners:
                listener(stats, outputs)
        elif kind == "failed":
            _, ids, reason = message
            self._deliver([(rid, EngineStepError(f"the engine failed while serving this "
                                                 f"request: {reason}"), True) for rid in ids])
        elif kind == "rejected":
            _, rid, reason = message
            self._deliver([(rid, ValueError(reason), True)])
        elif kind == "dead":
            self._die(message[1])

    def _die(self, reason: str) -> None:
        """The engine stopped: every request in flight fails now."""
        if self.error is None:
            log.error("engine stopped: %s", reason)
            self.error = reason
        with self._lock:
            ids = list(self._streams)
        self._deliver([(rid, EngineDeadError(reason), True) for rid in ids])

    def _deliver(self, items: list[tuple[str, object, bool]]) -> None:
        """Put each (request id, output or exception, last) on its stream: one wake-up of each
        event loop for all of them."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for rid, item, last in items:
                stream = self._streams.pop(rid, None) if last else self._streams.get(rid)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass


def _put_all(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class RequestStream:
    """One request's StreamOutputs, step by step. Closing it early aborts the request in the
    engine."""

    def __init__(self, client: EngineClient, request_id: str, stream: _Stream) -> None:
        self.client, self.request_id, self._stream = client, request_id, stream
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):  # refused, its step failed, or the engine died
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


# -- transports ------------------------------------------------------------------------------
class _ThreadTransport:
    """The engine loop in a thread of this process; messages through a queue."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, receive) -> None:
        loop = EngineLoop(self._engine, self._take, receive)
        self._thread = threading.Thread(target=loop.run, name="specserve-engine", daemon=True)
        self._thread.start()

    def _take(self, wait: bool) -> list[tuple]:
        messages = []
        try:
            messages.append(self._inbox.get(timeout=1.0) if wait else self._inbox.get_nowait())
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            return messages

    def send(self, message: tuple) -> None:
        self._inbox.put(message)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)


class _ProcessTransport:
    """The engine loop in a process of its own (spawned: no CUDA or thread state is forked);
    messages through a pipe. A sender thread writes it, so a large prompt never blocks the
    event loop while the engine is inside a step; a receiver thread reads it. The pipe's end
    is the engine process's end: every request in flight fails within a read."""

    LOAD_TIMEOUT_S = 3600.0

    def __init__(self, engine_config) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=engine_process_main, name="specserve-engine",
                                   args=(engine_config, child_conn, logging.getLogger().level),
                                   # a daemonic process may not start processes: tensor-parallel
                                   # ranks; without daemon it still ends with the pipe's end
                                   daemon=engine_config.tensor_parallel_size == 1)
        self.process.start()
        log.info("engine process started (pid %d); loading the engine there", self.process.pid)
        child_conn.close()
        self.info, self.stats = self._wait_loaded()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def _wait_loaded(self) -> tuple[EngineInfo, EngineStats]:
        if not self._conn.poll(self.LOAD_TIMEOUT_S):
            self.process.kill()
            raise EngineLoadError("the engine process did not load within an hour")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise EngineLoadError(f"the engine process exited while loading (exit code "
                               f"{self.process.exitcode})") from None
        if kind != "loaded":
            self.process.join(5)
            raise EngineLoadError(payload)
        return payload

    def start(self, receive) -> None:
        self._threads = [threading.Thread(target=self._write, name="specserve-engine-send",
                                          daemon=True),
                         threading.Thread(target=self._read, args=(receive,),
                                          name="specserve-engine-recv", daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine process is gone; the reader says so
                return
            if message[0] == "stop":
                return

    def _read(self, receive) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            receive(message)
            if message[0] == "dead":
                break
        if not self._stopping:
            self.process.join(1.0)
            code = self.process.exitcode
            receive(("dead", "the engine process exited" +
                     (f" (exit code {code})" if code is not None else "")))

    @property
    def running(self) -> bool:
        return self.process.is_alive() and not self._stopping

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()


def engine_process_main(engine_config, conn, log_level: int) -> None:
    """The engine process: load the engine, say so (or why not), run the loop until told to
    stop or until this process's parent is gone (the pipe's end). It ignores SIGINT and
    SIGTERM: a Ctrl-C or a signal to the whole process group is the server's to handle (it
    drains, then stops this process through the pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level or logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from engine import LLMEngine
    from engine.engine_stats import describe, snapshot
    from engine.models.loader import ModelLoadError

    try:
        engine = LLMEngine(engine_config)
    except Exception as exc:  # noqa: BLE001 - reported to the server, then the process ends
        if not isinstance(exc, (ModelLoadError, OSError, ValueError)):  # not the config's
            log.exception("the engine failed to load")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("loaded", (describe(engine), snapshot(engine))))
    except BaseException:  # the server is gone already: stop what the engine started
        engine.close()
        raise

    def take(wait: bool) -> list[tuple]:
        messages = []
        try:
            if conn.poll(1.0 if wait else 0):
                messages.append(conn.recv())
                while conn.poll(0):
                    messages.append(conn.recv())
        except (EOFError, OSError):  # the server is gone: stop
            messages.append(("stop",))
        return messages

    EngineLoop(engine, take, conn.send).run()
