"""Engine configuration (plain dataclass; the server wraps it in its pydantic config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # recipe name, local folder or hub id
    tokenizer: str | None = None  # defaults to the model's
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    model_cache_dir: str | None = None  # where recipes live (default ~/.cache/specserve/models)
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's, capped by what the pool can hold
    enable_prefix_caching: bool = True
    seed: int = 0  # for requests without a seed of their own
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid engine config {name}: must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("invalid engine config num_blocks: must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("invalid engine config kv_cache_memory_gb: must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("invalid engine config max_model_len: must be >= 2")
