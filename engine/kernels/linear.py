"""Measured choice of the matmul form for small-batch linear layers on the CPU.

Must not change what a layer computes, only how: `x @ W.T` (`F.linear`) and `(W @ x.T).T` are
the same product, but on some CPUs the BLAS kernels behind them differ several-fold for a few
rows (measured on 2 threads: 2 to 3 rows through `F.linear` cost 2-3x one row, while `W @ x.T`
costs about one). Decoding and verifying 1 + k tokens live exactly there, so each distinct
layer shape is timed once at start-up for a few row counts and the faster form is kept per
row count. GPUs are left alone: cuBLAS has no such cliff.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
MAX_ROWS = ROW_COUNTS[-1]
_tuned: dict[tuple, list[bool]] = {}  # (in, out, dtype, device) -> use (W @ x.T).T for rows


def _time(fn, repeats: int, min_seconds: float = 0.005) -> float:
    """Seconds per call: the best of `repeats` rounds, each long enough to average out noise."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, min(50, int(min_seconds / max(time.perf_counter() - t0, 1e-7))))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _tune(weight: torch.Tensor, repeats: int = 3) -> list[bool]:
    """Per row count 0..MAX_ROWS: True when (W @ x.T).T beats F.linear."""
    key = (weight.shape[1], weight.shape[0], weight.dtype, weight.device)
    if key in _tuned:
        return _tuned[key]
    wins = {}
    with torch.inference_mode():
        for rows in ROW_COUNTS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            plain = _time(lambda: F.linear(x, weight), repeats)
            transposed = _time(lambda: weight @ x.T, repeats)
            wins[rows] = transposed < 0.9 * plain  # only switch for a clear gain
    table = [False] * (MAX_ROWS + 1)
    for rows in range(1, MAX_ROWS + 1):  # a row count not timed follows the next timed one
        table[rows] = wins[min(r for r in ROW_COUNTS if r >= rows)]
    _tuned[key] = table
    return table


def _make_forward(module: torch.nn.Linear, table: list[bool]):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < rows <= MAX_ROWS and table[rows]:
            y = (self.weight @ x.reshape(rows, -1).T).T  # [rows, out]
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)

    return types.MethodType(forward, module)


def autotune_linears(model: torch.nn.Module) -> int:
    """Install the measured choice on every nn.Linear of a CPU model; returns how many use it."""
    switched = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
            continue
        table = _tune(module.weight.detach())
        if any(table):
            module.forward = _make_forward(module, table)
            switched += 1
    return switched
