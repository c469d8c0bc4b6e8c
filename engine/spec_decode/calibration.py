"""Start-up calibration of the k controller's cost model: time real forwards of a few sizes.

Must not change any sequence or the KV contents that matter: it runs on a dummy sequence whose
blocks it allocates and frees again. Each size is timed as live steps run it: a forward plus a
greedy pick from its logits (the verification every live target pass includes).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.batch import RunItem
from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.adaptive import ForwardCost, KController

# one sequence of this many tokens; SEQS one-token sequences for the per-sequence cost
TARGET_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
DRAFT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SEQS = 16
CONTEXT = 64  # tokens already in the cache of the timed sequence


def calibrate(controller: KController, block_manager: BlockManager, target: ModelRunner,
              draft: ModelRunner | None) -> None:
    """Seed `controller`'s target (and draft) cost with measured forwards; skipped when the
    pool cannot hold the dummy sequence."""
    dummy = Sequence("__calibration__", [0] * CONTEXT, SamplingParams())
    if not block_manager.allocate(dummy, CONTEXT + max(TARGET_TOKENS + DRAFT_TOKENS)):
        return
    try:
        _calibrate_runner(target, TARGET_TOKENS, controller.target_cost, dummy.block_table)
        if draft is not None:
            _calibrate_runner(draft, DRAFT_TOKENS, controller.draft_cost, dummy.block_table)
    finally:
        block_manager.free(dummy)


def _calibrate_runner(runner: ModelRunner, sizes: tuple[int, ...], cost: ForwardCost,
                      block_table: list[int]) -> None:
    def timed(items: list[RunItem]) -> float:
        return _best_seconds(lambda: runner.execute(items).logits.argmax(-1).tolist(),
                             runner.device)

    runner.execute([RunItem([0] * CONTEXT, 0, block_table, 1, CONTEXT)])  # warm-up
    # the measured steps' tokens come after a CONTEXT-token prompt: generated, as in decoding
    for n in sizes:
        cost.table.record(n, timed([RunItem([0] * n, CONTEXT, block_table, n, CONTEXT)]))
    seconds = timed([RunItem([0], CONTEXT, block_table, 1, CONTEXT)] * SEQS)
    cost.per_seq = max(seconds - cost.table(SEQS), 0.0) / (SEQS - 1)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
