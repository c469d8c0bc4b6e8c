"""The draft model: loaded like the target, optionally with weight-only quantized linears.

Must not touch the engine. The draft's numerics never change what is emitted (the verifier
decides), so it may use whatever kernel is fastest.
"""

from __future__ import annotations

import torch

from engine.config import SpeculativeConfig
from engine.models.loader import load_model, resolve_model_path
from engine.models.quantize import apply_quantization


def load_draft(config: SpeculativeConfig, target: torch.nn.Module, target_dtype: str,
               cache_dir: str | None = None) -> torch.nn.Module:
    """The draft model named by `config`, on the target's device (in its dtype by default)."""
    device = str(next(target.parameters()).device)
    draft, _ = load_model(config.draft_model, dtype=config.draft_dtype or target_dtype,
                          device=device, gguf_file=config.draft_gguf_file, cache_dir=cache_dir)
    return draft


def draft_source(config: SpeculativeConfig, cache_dir: str | None = None) -> str | None:
    """The draft's folder (where a stored GGUF form lives), if it is one."""
    try:
        return resolve_model_path(config.draft_model, cache_dir)
    except FileNotFoundError:
        return None


def prepare_draft(draft: torch.nn.Module, quantization: str, owned: bool,
                  source: str | None = None, int4_kernel: str = "auto") -> torch.nn.Module:
    """Apply `quantization` (engine/models/quantize.py; `source`: the draft's folder). A
    caller's model (not `owned`) is never changed in place."""
    return apply_quantization(draft, quantization, source, owned, what="draft",
                              int4_kernel=int4_kernel)
