"""How much device memory the KV pool may take on CUDA, with the CUDA graphs accounted first.

Everything else the engine keeps on the device comes before the pool: the weights (loaded
already), the activation peak of the largest step (an eager prompt chunk of
`max_num_batched_tokens`, or the largest static bucket), and what the CUDA graphs keep: the
output logits all buckets share ([largest sequences x tokens, vocab], for the target and the
draft model), plus each runner's graph memory pool, about one largest-bucket forward (with
split-KV attention, plus its partials over the longest context the buckets cover). The
pool gets `kv_cache_memory_gb`, or less when that does not fit under `gpu_memory_utilization`
of the device's memory (logged); a pool of no room is an error that
names the setting to change. On the CPU the pool is simply `kv_cache_memory_gb`.

`plan_kv_bytes` is the arithmetic (tested on any machine); `measure_step_peak` runs real
forwards on the device before the pool is allocated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("specserve.engine")

GiB = 1 << 30


@dataclass
class MemoryPlan:
    total: int  # device memory, bytes
    in_use: int  # allocated before the pool (weights, the profiling pool)
    step_peak: int  # activation peak of the largest eager step
    graphs: int  # kept by the CUDA graphs (bucket outputs + graph pools)
    kv_bytes: int  # what the pool gets

    def describe(self) -> str:
        return (f"device {self.total / GiB:.1f} GiB: in use {self.in_use / GiB:.2f}, step peak "
                f"{self.step_peak / GiB:.2f}, CUDA graphs {self.graphs / GiB:.2f}, KV pool "
                f"{self.kv_bytes / GiB:.2f} GiB")


def graph_output_bytes(batch_sizes: tuple[int, ...], tokens_per_seq: int, vocab_size: int,
                       itemsize: int) -> int:
    """What the captured buckets' output logits keep: one [largest size x tokens_per_seq,
    vocab] tensor in the model's dtype, which every bucket writes (static_steps.py)."""
    return max(batch_sizes, default=0) * tokens_per_seq * vocab_size * itemsize


def split_partial_bytes(rows: int, heads: int, head_dim: int, num_splits: int) -> int:
    """What split-KV attention allocates during one layer: float32 partials (max, sum,
    weighted values) of `rows` split rows x heads x `num_splits` splits each (an eager step's
    or a static bucket's rows, at the longest context)."""
    return rows * heads * num_splits * (head_dim + 2) * 4


def plan_kv_bytes(requested: int, total: int, in_use: int, utilization: float,
                  step_peak: int, graphs: int) -> MemoryPlan:
    """The pool's bytes: `requested`, cut to what fits under utilization x total after
    everything else (see the module docstring)."""
    room = int(utilization * total) - in_use - step_peak - graphs
    plan = MemoryPlan(total, in_use, step_peak, graphs, min(requested, room))
    if room <= 0:
        raise ValueError(
            f"invalid engine config gpu_memory_utilization: {utilization} of the device leaves "
            f"no room for the KV pool ({plan.describe()}); raise it, lower "
            f"cuda_graph_batch_sizes or max_num_batched_tokens, or set cuda_graphs: off")
    if requested > room:
        log.warning("kv_cache_memory_gb %.2f GiB does not fit under gpu_memory_utilization "
                    "%.2f; the KV pool gets %.2f GiB (%s)", requested / GiB, utilization,
                    room / GiB, plan.describe())
    return plan


def measure_step_peak(runner, num_tokens: int, bucket_seqs: int, bucket_tokens: int,
                      block_table: list[int]) -> tuple[int, int]:
    """(peak of an eager prompt chunk of `num_tokens`, peak of the largest static bucket run
    eagerly), in bytes above what was allocated before, measured on CUDA with token 0 at
    every position of `block_table`'s blocks."""
    from engine.model_runner import RunItem

    peaks = []
    for items in ([RunItem([0] * num_tokens, 0, block_table, 1)],
                  [RunItem([0] * bucket_tokens, 0, block_table, bucket_tokens)] * bucket_seqs):
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
        runner.execute(items)
        torch.cuda.synchronize(runner.device)
        peaks.append(torch.cuda.max_memory_allocated(runner.device) - base)
    return peaks[0], peaks[1]
