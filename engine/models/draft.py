"""The draft model: loaded like the target, optionally with weight-only int8 linears.

Must not touch the engine. The draft's numerics never change what is emitted (the verifier
decides), so it may use whatever kernel is fastest.
"""

from __future__ import annotations

import copy
import warnings

import torch

from engine.config import SpeculativeConfig
from engine.models.loader import load_model


def load_draft(config: SpeculativeConfig, target: torch.nn.Module, target_dtype: str,
               cache_dir: str | None = None) -> torch.nn.Module:
    """The draft model named by `config`, on the target's device (in its dtype by default)."""
    device = str(next(target.parameters()).device)
    draft, _ = load_model(config.draft_model, dtype=config.draft_dtype or target_dtype,
                          device=device, gguf_file=config.draft_gguf_file, cache_dir=cache_dir)
    return draft


def prepare_draft(draft: torch.nn.Module, quantization: str, owned: bool) -> torch.nn.Module:
    """Apply `quantization` ("none" | "int8"). A caller's model (not `owned`) is never changed
    in place; one the engine loaded itself is converted in place (half the peak memory)."""
    if quantization != "int8":
        return draft
    if next(draft.parameters()).device.type != "cpu":
        raise ValueError("invalid speculative config draft_quantization: int8 runs on the "
                         "CPU only")
    from torch.ao.quantization import quantize_dynamic

    # dynamic int8 linears take fp32 activations
    if owned or draft.dtype == torch.float32:
        fp32, inplace = draft.float(), owned
    else:
        fp32, inplace = copy.deepcopy(draft).float(), True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks the quantized tensor API deprecated
        return quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8, inplace=inplace)
