"""This process's place in the target's tensor-parallel group: torch.distributed (NCCL on CUDA,
gloo on the CPU) and the two collectives a split forward needs. Must not schedule or sample.

`reduce` adds the ranks' partial outputs of a row-parallel layer in a FIXED order: every rank
gathers all parts and adds them rank 0 first, in float32, then rounds once to the model's
dtype. A ring all-reduce would add an element's parts in an order that depends on where the
element falls in the buffer (its chunking follows the buffer's size, that is the batch), so a
row's bits would depend on the other rows of the step; gathering costs N times the traffic of
one part and keeps every row's sum the same alone or batched. `check_reduce` verifies that at
start-up, as engine/kernels/batch_invariant.py does for the kernels.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# a collective waits for the slowest rank's share of the same forward; one stuck this long
# means a rank is gone or hung (the step then fails, and the engine with it)
COLLECTIVE_TIMEOUT_S = 300.0
STORE_TIMEOUT_S = 600.0  # ranks load their models before they join


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, store_port: int,
                 store: dist.TCPStore | None = None) -> None:
        """Join the group (rank 0 passes the store it created; the others connect to its
        port on this machine)."""
        self.rank, self.size, self.device = rank, size, device
        if store is None:
            store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                                  timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                **kwargs)

    @staticmethod
    def create_store(size: int) -> dist.TCPStore:
        """Rank 0's store on a free port of this machine (`.port`)."""
        return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x` (every rank's partial output, same shape), added in rank
        order in float32 and rounded once to x's dtype; the same on every rank."""
        x = x.contiguous()
        if self.backend == "nccl":
            parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(parts, x)
            parts = list(parts.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(x.dtype)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (the others pass a tensor of its shape and dtype)."""
        dist.broadcast(x, src=0)
        return x

    def check_reduce(self, hidden: int, dtype: torch.dtype, rows: int = 48) -> bool:
        """Every rank: does a row's reduced value depend on the rows reduced with it? Reduces
        a batch of random rows, then each of a few rows alone and in calls of other sizes, and
        compares the bits (collective: every rank calls it with the same arguments)."""
        gen = torch.Generator().manual_seed(1234 + self.rank)
        batch = torch.randn(rows, hidden, generator=gen).to(dtype).to(self.device)
        whole = self.reduce(batch)
        same = True
        for start, count in ((0, 1), (5, 1), (7, 3), (16, 17), (rows - 1, 1)):
            part = self.reduce(batch[start:start + count])
            same &= torch.equal(part, whole[start:start + count])
        return same

    def abort(self) -> None:
        """Fail every collective in flight or to come (NCCL's abort; gloo fails on its own
        when a peer's connection closes)."""
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()

    def close(self, abort: bool = False) -> None:
        """Leave the group; `abort`: a rank is gone (NCCL might wait for it)."""
        if abort and self.backend == "nccl":
            self.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
