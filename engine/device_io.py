"""Host <-> device transfers of a step: copies to the device that never make the host wait,
and ONE copy of the step's results back.

On CUDA, `torch.tensor(python_list, device="cuda")` and `.to("cuda")` from pageable memory
synchronize the stream: the host waits until every kernel queued before the copy has run, so a
step that builds ten small metadata tensors that way waits for the GPU ten times. Here host
data is staged in pinned memory (torch's caching host allocator keeps a staged buffer alive
until its copy has run) and copied `non_blocking`; the kernels that read it are queued behind
the copy on the same stream. The host reads results only through `fetch`, which copies every
tensor it is given into pinned memory and then waits once.

On the CPU both are plain (no copies at all for host data already in a tensor), and `fetch`
counts its calls all the same: tests check that a step calls it once and reads no device value
any other way.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class TransferStats:
    """Calls of `fetch` (the test hook: a step with logits rows makes exactly one)."""

    def __init__(self) -> None:
        self.fetches = 0


stats = TransferStats()


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor of `data` (a list, a numpy array or a CPU tensor) whose copy does not
    block the host."""
    host = data if isinstance(data, torch.Tensor) else torch.as_tensor(
        np.asarray(data), dtype=dtype)
    host, device = host.to(dtype), torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, src: np.ndarray) -> None:
    """Copy host array `src` into the device tensor `dst` (same shape) without blocking."""
    host = torch.from_numpy(src)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.device.type != "cpu")


def fetch(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The step's results on the host: every tensor copied back, then ONE wait. Returns CPU
    tensors (None stays None)."""
    stats.fetches += 1
    out: list[torch.Tensor | None] = []
    wait = None
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        cuda = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        host.copy_(t, non_blocking=cuda)  # elsewhere a plain, blocking copy
        wait = t.device if cuda else wait
        out.append(host)
    if wait is not None:
        torch.cuda.current_stream(wait).synchronize()
    return out


def lists(*tensors: torch.Tensor | None) -> list[list | None]:
    """`fetch`, as Python lists."""
    return [None if t is None else t.tolist() for t in fetch(*tensors)]


class Marks:
    """Points in a device's work queue, timed without a wait of their own: CUDA events on
    CUDA, the host clock elsewhere (where work runs as it is issued). Read `seconds` only after
    the work is done (after a `fetch`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


def healthy(device: torch.device) -> bool:
    """The device still runs work: after a CUDA error (sticky: every later call fails) it does
    not. Always true on the CPU."""
    if torch.device(device).type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any failure means the device is gone
        return False
