"""What the engine tells the outside about itself, as plain picklable values: `EngineInfo` once
at start (what it serves, its limits) and an `EngineStats` snapshot after every step (queues, KV
usage, cumulative counters). The server's metrics and readiness read these and nothing else of
the engine, so the engine can run in another process.

Must not know about HTTP or Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineInfo:
    model: str
    draft_model: str
    speculative_method: str
    k_max: int
    adaptive: bool
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    batch_invariant: bool
    eos_token_ids: frozenset[int]
    tensor_parallel_size: int = 1

    def labels(self) -> dict[str, str]:
        """The served configuration as metric labels (the engine's model name as
        `engine_model`; not the vocabulary, slots or end-of-sequence ids)."""
        labels = {k: str(v) for k, v in self.__dict__.items()
                  if k not in ("model", "vocab_size", "max_num_seqs", "eos_token_ids")}
        return {"engine_model": self.model, **labels}


@dataclass
class EngineStats:
    """The engine after a step: gauges as they are now, counters as totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # target KV blocks in use (0-1)
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0
    grammar_requests: int = 0
    grammar_mask_seconds: float = 0.0
    speculating: bool = False
    draft_kv_usage: float = 0.0  # the draft model's KV shares the target's block ids
    mean_k: float = 0.0  # in the latest decoding step
    num_drafts: int = 0
    by_method: dict[str, tuple[int, int]] = field(default_factory=dict)  # drafted, accepted
    suffix_cache_tokens: int = 0
    tree_verifications: int = 0  # verifications of token trees
    tree_nodes: int = 0  # ... and their nodes
    chain_steps_chosen: int = 0  # steps the guard drafted chains where trees were possible
    accepted_per_pos: list[int] = field(default_factory=list)
    # tokens emitted by each verification with drafts since the previous snapshot
    recent_lengths: list[int] = field(default_factory=list)
    # tensor parallelism: per rank (rank, alive, weight bytes, KV pool bytes); empty for one
    ranks: list[tuple[int, bool, int, int]] = field(default_factory=list)


def describe(engine) -> EngineInfo:
    """`engine` (an LLMEngine) as it was built."""
    cfg, spec = engine.config, engine.config.speculative
    invariance = engine.runner.invariance
    return EngineInfo(
        model=cfg.model, draft_model=spec.draft_model or "", speculative_method=spec.method,
        k_max=spec.k_max, adaptive=spec.adaptive, dtype=cfg.dtype, device=str(engine.device),
        block_size=cfg.block_size, num_blocks=engine.block_manager.num_blocks,
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
        batch_invariant=bool(invariance and invariance.invariant
                             and (engine.workers is None or engine.workers.invariant)),
        eos_token_ids=frozenset(engine.scheduler.eos_token_ids),
        tensor_parallel_size=cfg.tensor_parallel_size)


def snapshot(engine) -> EngineStats:
    """`engine` now; takes (empties) the speculator's recent accepted lengths."""
    blocks, prefix = engine.block_manager, engine.block_manager.prefix_stats
    stats = EngineStats(
        num_running=engine.num_running, num_waiting=engine.num_waiting, kv_usage=blocks.usage,
        num_preemptions=engine.scheduler.stats.num_preemptions, prefix_queries=prefix.queries,
        prefix_hits=prefix.hits, grammar_requests=engine.num_grammar_requests,
        grammar_mask_seconds=engine.grammar_mask_seconds)
    if engine.workers is not None:
        stats.ranks = [(r.rank, r.alive, r.weight_bytes, r.kv_bytes)
                       for r in engine.workers.ranks()]
    speculator = engine.speculator
    if speculator.enabled:
        st = speculator.stats
        stats.speculating = True
        stats.draft_kv_usage = blocks.usage if speculator.config.uses_draft_model else 0.0
        stats.mean_k, stats.num_drafts = st.last_mean_k, st.num_drafts
        stats.by_method = {m: (c[1], c[2]) for m, c in st.by_method.items()}
        stats.suffix_cache_tokens = st.suffix_cache_tokens
        stats.tree_verifications, stats.tree_nodes = st.num_tree_verifications, st.num_tree_nodes
        stats.chain_steps_chosen = st.num_chain_steps_chosen
        stats.accepted_per_pos = list(st.accepted_per_pos)
        stats.recent_lengths = st.take_recent_lengths()
    return stats
