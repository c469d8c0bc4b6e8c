"""The engine's models: the target (with its tokenizer) and the draft model speculation needs.

Must not build a runner or touch the KV cache: it loads and quantizes models, nothing more.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.models.draft import draft_source, load_draft, prepare_draft
from engine.models.loader import load_model, resolve_device, resolve_model_path
from engine.models.quantize import apply_quantization


def load_models(config: EngineConfig, model: torch.nn.Module | None, tokenizer,
                draft: torch.nn.Module | None) -> tuple[torch.nn.Module, object,
                                                         torch.nn.Module | None]:
    """(target, tokenizer, draft model or None), each loaded here unless given, quantized as
    the config says (a given model is quantized in place only where it may be); with tensor
    parallelism the target is rank 0's share."""
    model, tokenizer = load_target(config, model, tokenizer, rank=0)
    return model, tokenizer, _draft_model(config, model, draft)


def load_target(config: EngineConfig, model: torch.nn.Module | None, tokenizer,
                rank: int = 0) -> tuple[torch.nn.Module, object]:
    """(target, tokenizer): loaded here unless given; with `tensor_parallel_size` N > 1, only
    rank `rank`'s share of it (engine/parallel/shard.py: split on the host, then moved to the
    rank's device), then quantized as the config says."""
    owned = model is None
    size = config.tensor_parallel_size
    if owned:
        model, tokenizer = load_model(
            config.model, dtype=config.dtype, device="cpu" if size > 1 else config.device,
            gguf_file=config.gguf_file, tokenizer=config.tokenizer,
            cache_dir=config.model_cache_dir)
    source = resolve_model_path(config.model, config.model_cache_dir) if owned else None
    if size > 1:
        from engine.parallel.shard import check_tensor_parallel, rank_device, shard_model

        device = resolve_device(config.device)
        check_tensor_parallel(model.config, size, device, config.quantization,
                              type(model).__name__)
        model = shard_model(model, rank, size, owned).to(rank_device(device, rank))
        owned = True  # the share is a model of its own
    model = apply_quantization(model, config.quantization, source, owned, what="target",
                               int4_kernel=config.int4_kernel)
    return model, tokenizer


def _draft_model(config: EngineConfig, target: torch.nn.Module,
                 given: torch.nn.Module | None) -> torch.nn.Module | None:
    """The draft model speculation needs (loaded here unless `given`), or None."""
    speculative = config.speculative
    if not speculative.uses_draft_model:
        return None
    owned = given is None  # loaded here: nobody else holds it
    draft = load_draft(speculative, target, config.dtype,
                       config.model_cache_dir) if owned else given
    return prepare_draft(draft, speculative.draft_quantization, owned,
                         draft_source(speculative, config.model_cache_dir)
                         if owned else None, int4_kernel=config.int4_kernel,
                         private=speculative.draft_vocab_size > 0)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """The model's end-of-sequence ids: its generation config's and its tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None) if tokenizer else None):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
