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
forwards on the device before the pool is allocated; `plan_blocks` puts the two together for
the engine. Must not allocate the pool itself: the model runners do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.paged import PagedKVCache
from engine.batch import ModelShape, RunItem

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


def bytes_per_block(models: list[torch.nn.Module], block_size: int, heads: tuple = ()) -> int:
    """KV bytes of one block id: a draft model's KV, and a draft head's one layer
    (engine/spec_decode/eagle.py `EagleHead`), share the same block ids."""
    per_block = 0
    for model in models:
        shape = ModelShape.of(model)
        per_block += PagedKVCache.bytes_per_block(shape.num_layers, block_size,
                                                  shape.num_kv_heads, shape.head_dim,
                                                  model.get_input_embeddings().weight.dtype)
    dtype = models[0].get_input_embeddings().weight.dtype
    for head in heads:  # an EAGLE head's one layer (Medusa heads keep no KV)
        if not hasattr(head.config, "num_kv_heads"):
            continue
        per_block += PagedKVCache.bytes_per_block(1, block_size, head.config.num_kv_heads,
                                                  head.config.head_dim, dtype)
    return per_block


def blocks_for_memory(config, models: list[torch.nn.Module], heads: tuple = ()) -> int:
    """Blocks that fit kv_cache_memory_gb (an EngineConfig's)."""
    return max(1, int(config.kv_cache_memory_gb * GiB
                      // bytes_per_block(models, config.block_size, heads)))


def static_tokens(config) -> int:
    """Tokens per sequence of the largest static bucket: 1 + k_max."""
    spec = config.speculative
    return 1 + (spec.k_max if spec.enabled else 0)


def static_tree_tokens(config) -> int:
    """Rows per sequence of the largest token-tree step a static bucket takes (0: none):
    1 + the most nodes of a tree."""
    nodes = config.speculative.max_tree_nodes
    return 1 + nodes if nodes else 0


def profile_blocks(config) -> int:
    """A pool just large enough for the forwards `plan_blocks` measures."""
    tokens = max(config.max_num_batched_tokens, static_tokens(config))
    return -(-tokens // config.block_size) + 1


def max_model_len(config, model: torch.nn.Module, num_blocks: int) -> int:
    """The context length: the config's, else the model's, within the pool."""
    model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    limit = config.max_model_len or model_len or num_blocks * config.block_size
    # One sequence must always fit in the pool, or preemption could never make room.
    return min(limit, num_blocks * config.block_size)


def plan_blocks(cfg, runner, models: list[torch.nn.Module], heads: tuple,
                captured: bool) -> int:
    """CUDA: the pool's blocks once weights, the largest step and the CUDA graphs are
    accounted (`runner`: the target's, on a profile pool of `profile_blocks`; `heads`: a draft
    head, loaded already, whose KV shares the block ids; `captured`: the runner plan captures
    CUDA graphs)."""
    device, tokens = runner.device, static_tokens(cfg)
    sizes = tuple(cfg.cuda_graph_batch_sizes) if captured else ()
    chunk_peak, bucket_peak = measure_step_peak(
        runner, cfg.max_num_batched_tokens, max(sizes, default=cfg.max_num_seqs), tokens,
        list(range(runner.kv.num_blocks)))
    graphs = sum(graph_output_bytes(sizes, tokens, ModelShape.of(m).vocab_size,
                                    m.get_input_embeddings().weight.element_size())
                 for m in models)
    graphs += bucket_peak * len(models) if captured else 0  # each runner's graph pool
    if cfg.attention_kv_split:
        chunk_extra, graph_extra = _split_partials(cfg, models, sizes, tokens, captured)
        chunk_peak, graphs = chunk_peak + chunk_extra, graphs + graph_extra
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    profile_kv = runner.kv.num_blocks * bytes_per_block([models[0]], cfg.block_size)
    in_use = total - free - cached - profile_kv
    plan = plan_kv_bytes(int(cfg.kv_cache_memory_gb * GiB), total, in_use,
                         cfg.gpu_memory_utilization, max(chunk_peak, bucket_peak), graphs)
    log.info("memory plan: %s", plan.describe())
    return max(1, plan.kv_bytes // bytes_per_block(models, cfg.block_size, heads))


def _split_partials(cfg, models: list[torch.nn.Module], sizes: tuple[int, ...], tokens: int,
                    captured: bool) -> tuple[int, int]:
    """Split-KV attention's partials at the longest context (the measured steps have no
    generated rows): (for an eager chunk of generated rows, a preemption's recompute; kept by
    the graph pools, for each runner's largest bucket)."""
    pool_tokens = (int(cfg.kv_cache_memory_gb * GiB) // bytes_per_block(models, cfg.block_size)
                   * cfg.block_size)  # the KV pool bounds max_model_len (<= requested)
    longest = min(max_model_len(cfg, models[0], 1 << 40), pool_tokens)
    most = -(-longest // cfg.attention_kv_split)
    shapes = [(m.config.get_text_config().num_attention_heads, ModelShape.of(m).head_dim)
              for m in models]
    chunk = max(split_partial_bytes(cfg.max_num_batched_tokens, h, d, most) for h, d in shapes)
    graphs = sum(split_partial_bytes(max(sizes) * tokens, h, d, most)
                 for h, d in shapes) if captured else 0
    return chunk, graphs


def log_ranks(ranks) -> None:
    """Tensor parallelism: each rank's share of the weights and its KV pool (every rank holds
    its share of the KV heads for the same block ids; rank 0 also the draft's)."""
    for r in ranks:
        log.info("memory plan rank %d: weights %.2f GiB, KV pool %.2f GiB", r.rank,
                 r.weight_bytes / GiB, r.kv_bytes / GiB)
