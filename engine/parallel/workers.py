"""The target's tensor-parallel ranks 1..N-1: processes that run each forward of the target with
rank 0. Must not schedule, sample or speculate: a worker only follows rank 0's forwards.

Rank 0 (the engine) starts them (spawned: no CUDA or thread state is forked), each with a pipe.
Per forward, rank 0 sends the step's metadata down every pipe (positions, KV slots, per
sequence its span, a token tree's parents included: what the attention backend needs;
`Workers.step`; after a tree's verification, its K/V moves: `Workers.compact`), then
broadcasts the input ids over the group (a device tensor: drafts a draft model left on the
device travel without a host read) and all ranks run the same forward, meeting at each
layer's reduce. Only rank 0 computes logits. A worker idles in its pipe's `recv`, so no
collective waits while the server has nothing to do.

Failure is loud: a worker that raises exits, which fails rank 0's next collective at once
(gloo and NCCL see the closed connection); a rank-0 forward that raised part-way leaves the
workers inside it, so the group is `broken` and the engine cannot go on (the server answers
503 and exits). Rank 0 gone: a worker's pipe ends and it exits.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.batch import StepMeta
from engine.models.loader import resolve_dtype
from engine.parallel.group import TPGroup
from engine.parallel.shard import devices, rank_device

log = logging.getLogger("specserve.engine")

JOIN_TIMEOUT_S = 120.0  # a spawned worker imports torch and joins within this
LOAD_TIMEOUT_S = 3600.0  # ... and loads its share of the model within this
REDUCE_CHECK_HIDDEN = 512  # features per row of the start-up check of the reduce


class WorkerError(RuntimeError):
    """A tensor-parallel rank that failed to start or load (the message says which and why)."""


@dataclass
class RankStatus:
    rank: int
    alive: bool
    weight_bytes: int = 0  # the rank's share of the target's weights
    kv_bytes: int = 0  # its KV pool (0 before the runner is built)
    invariant: bool = True  # its kernels passed its batch-invariance check


def threads_per_rank(config, device: torch.device) -> int:
    """Torch threads of each rank on the CPU: the configured number, or the cores shared out."""
    if config.num_threads:
        return config.num_threads
    if device.type == "cuda":
        return torch.get_num_threads()
    return max(1, devices(device) // config.tensor_parallel_size)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights, each storage once (merged projections are viewed by
    the layers they merge: engine/models/lean_forward.py `merge_projections`)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t.numel()}
    return sum(storages.values())


class Workers:
    """Rank 0's handle on ranks 1..N-1 and its own membership of the group."""

    def __init__(self, config, model: torch.nn.Module | None, device: torch.device) -> None:
        """Start ranks 1..N-1 and join the group with them. `model`: the whole target a caller
        gave the engine (each worker takes its share of it), None: they load config.model."""
        self.size = size = config.tensor_parallel_size
        store = TPGroup.create_store(size)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"specserve-tp{rank}", daemon=True,
                               args=(rank, store.port, config, model, theirs,
                                     logging.getLogger().level))
            proc.start()
            log.info("tensor-parallel rank %d started (pid %d)", rank, proc.pid)
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.broken: str | None = None  # why the group cannot run another forward
        self.status = [RankStatus(r, True) for r in range(size)]
        self._closing = False
        try:
            for rank in range(1, size):
                self._expect(rank, "joining", JOIN_TIMEOUT_S)
            self.group = TPGroup(0, size, device, store.port, store)
            self.reduce_invariant = self.group.check_reduce(REDUCE_CHECK_HIDDEN,
                                                            resolve_dtype(config.dtype))
            if not self.reduce_invariant:
                log.warning("the sum over tensor-parallel ranks is not batch-invariant here: "
                            "greedy output may change with batching and speculation")
        except BaseException:
            self.close()
            raise
        self._store = store  # the group's store lives as long as the group
        threading.Thread(target=self._watch, args=(list(self.procs),), daemon=True,
                         name="specserve-tp-watch").start()

    def _watch(self, procs: list) -> None:
        """The moment a worker process ends outside `close`, the group is broken; on NCCL,
        which does not notice a peer gone, rank 0's collectives are aborted too (a step
        inside one fails instead of waiting for the timeout)."""
        ended = multiprocessing.connection.wait([p.sentinel for p in procs])
        if self._closing:
            return
        # (no join or exitcode here: two threads reaping one child confuse multiprocessing)
        rank = next(r for r, p in enumerate(procs, start=1) if p.sentinel in ended)
        self.fail(f"tensor-parallel rank {rank} exited (its log lines say why)")
        if self.group is not None and self.group.backend == "nccl":
            self.group.abort()

    @property
    def invariant(self) -> bool:
        """The reduce and every rank's kernels passed their batch-invariance checks."""
        return self.reduce_invariant and all(s.invariant for s in self.status)

    def _expect(self, rank: int, kind: str, timeout_s: float):
        """Rank `rank`'s next message, which must be `kind`; its payload."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.join(1.0)
                raise WorkerError(f"tensor-parallel rank {rank} " + (
                    f"exited (code {proc.exitcode}) before it was {kind}" if not proc.is_alive()
                    else f"was not {kind} within {timeout_s:.0f} s"))
        try:
            got, payload = conn.recv()
        except EOFError:
            proc.join(5.0)
            raise WorkerError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) "
                              f"before it was {kind}") from None
        if got == "error":
            raise WorkerError(f"tensor-parallel rank {rank}: {payload}")
        if got != kind:
            raise WorkerError(f"tensor-parallel rank {rank} said {got!r}, expected {kind!r}")
        return payload

    def _record(self, kind: str, **mine) -> None:
        """Rank 0's values `mine` and each worker's answer `kind` (a dict of the same
        `RankStatus` fields) in every rank's status."""
        for rank in range(self.size):
            values = mine if rank == 0 else self._expect(rank, kind, LOAD_TIMEOUT_S)
            for field, value in values.items():
                setattr(self.status[rank], field, value)

    def wait_loaded(self, weight_bytes: int) -> None:
        """Every worker has its share of the model (rank 0's own: `weight_bytes`)."""
        self._record("loaded", weight_bytes=weight_bytes)

    def start_runners(self, plan, num_blocks: int) -> None:
        """Every worker builds its runner by rank 0's `RunnerPlan` (engine/runner_plan.py; on
        its own device) on a pool of `num_blocks` (rank 0's number)..."""
        self._send(("runner", plan, num_blocks))

    def wait_runners(self, kv_bytes: int) -> None:
        """... and has it (rank 0's pool: `kv_bytes`)."""
        self._record("ready", kv_bytes=kv_bytes)

    def resize_kv(self, num_blocks: int, kv_bytes: int) -> None:
        """Every worker's pool resized to `num_blocks`, as rank 0's (now `kv_bytes`)."""
        self._send(("resize", num_blocks))
        self._record("resized", kv_bytes=kv_bytes)

    def step(self, meta: StepMeta) -> None:
        """Tell every worker to run the forward rank 0 is about to run."""
        self._send(("step", meta))

    def compact(self, moves: list[tuple[list[int], int, int]]) -> None:
        """Tell every worker to move K/V as rank 0 does after a token tree's verification
        (`ModelRunner.compact`): before its next forward, as the pipe keeps the order."""
        self._send(("compact", moves))

    def _send(self, message: tuple) -> None:
        if self.broken:
            raise RuntimeError(f"tensor parallelism is broken: {self.broken}")
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (OSError, ValueError) as exc:
                self.fail(f"rank {rank} is gone ({exc})")
                raise RuntimeError(f"tensor-parallel rank {rank} is gone") from exc

    def fail(self, why: str) -> None:
        """The ranks are out of step (a forward failed part-way, a rank died): no forward can
        run again."""
        if self.broken is None:
            self.broken = why
            log.error("tensor parallelism is broken: %s", why)

    def problem(self) -> str | None:
        """Why no forward can run now (a rank is out of step or gone), or None."""
        down = [rank for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        return self.broken or (f"tensor-parallel rank(s) {down} exited" if down else None)

    def healthy(self) -> bool:
        """Every rank is alive and in step."""
        return self.problem() is None

    def ranks(self) -> list[RankStatus]:
        """Every rank's status now (rank 0 is alive while it answers)."""
        for rank, proc in enumerate(self.procs, start=1):
            self.status[rank].alive = proc.is_alive()
        return [RankStatus(**vars(s)) for s in self.status]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers and leave the group (aborting it when broken: NCCL may not finish
        a collective a dead rank was in). No forward runs afterwards."""
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        group = getattr(self, "group", None)
        if group is not None:
            group.close(abort=self.broken is not None)
            self.group = None
        self.broken = self.broken or "closed"


# -- the worker process -----------------------------------------------------------------------
def worker_main(rank: int, store_port: int, config, model: torch.nn.Module | None, conn,
                log_level: int) -> None:
    """Rank `rank`: join the group, load its share of the target, follow rank 0's forwards
    until told to stop or rank 0 is gone."""
    from engine.models.loader import resolve_device

    logging.basicConfig(level=log_level, format=f"%(asctime)s tp{rank} %(levelname)s "
                                                 f"%(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server's to handle: it stops us
        signal.signal(sig, signal.SIG_IGN)
    group = None
    try:
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(threads_per_rank(config, device))
        conn.send(("joining", None))
        group = TPGroup(rank, config.tensor_parallel_size, device, store_port)
        group.check_reduce(REDUCE_CHECK_HIDDEN, resolve_dtype(config.dtype))  # with rank 0
        _serve(rank, config, model, conn, group)
    except EOFError:  # rank 0 is gone
        pass
    except BaseException as exc:  # noqa: BLE001 - said to rank 0, then the process ends
        log.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
        os._exit(1)  # closes our end of every collective: rank 0's next one fails at once
    if group is not None:
        group.close()


def _serve(rank: int, config, model: torch.nn.Module | None, conn, group: TPGroup) -> None:
    from engine.models.pair import load_target

    model, _ = load_target(config, model, None, rank=rank)
    conn.send(("loaded", {"weight_bytes": model_bytes(model)}))
    runner = None
    while True:
        kind, *args = conn.recv()
        if kind == "stop":
            return
        if kind == "runner":  # rank 0's plan (one decision), on this rank's device
            plan, num_blocks = args
            runner = replace(plan, device=group.device).runner(model, num_blocks,
                                                               config.block_size)
            runner.join_group(group)
            invariant = runner.invariance is None or runner.invariance.invariant
            conn.send(("ready", {"kv_bytes": runner.kv_bytes, "invariant": invariant}))
        elif kind == "resize":
            runner.resize_kv(args[0])
            conn.send(("resized", {"kv_bytes": runner.kv_bytes}))
        elif kind == "step":
            runner.follow(args[0])
        elif kind == "compact":
            runner.compact(args[0])
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
