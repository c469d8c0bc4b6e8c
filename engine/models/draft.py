"""The draft model: loaded like the target, optionally with weight-only quantized linears.

Must not touch the engine. The draft's numerics never change what is emitted (the verifier
decides), so it may use whatever kernel is fastest.
"""

from __future__ import annotations

import copy

import torch

from engine.config import SpeculativeConfig
from engine.models.loader import ModelLoadError, load_model, resolve_model_path
from engine.models.quantize import apply_quantization

SUBSET_MULTIPLE = 64  # a vocabulary subset's size is rounded up to this (the int4 kernels' rows)


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
    except ModelLoadError:
        return None


def prepare_draft(draft: torch.nn.Module, quantization: str, owned: bool,
                  source: str | None = None, int4_kernel: str = "auto",
                  private: bool = False) -> torch.nn.Module:
    """Apply `quantization` (engine/models/quantize.py; `source`: the draft's folder). A
    caller's model (not `owned`) is never changed in place; with `private` (the engine will
    change the model: a vocabulary subset) it is copied even when nothing is quantized."""
    if private and not owned and quantization == "none":
        draft, owned = copy.deepcopy(draft), True
    return apply_quantization(draft, quantization, source, owned, what="draft",
                              int4_kernel=int4_kernel)


def draft_vocabulary(tokenizer, size: int, vocab_size: int) -> torch.Tensor | None:
    """The token ids a draft with a vocabulary subset of `size` scores ([n] long, ascending),
    or None for the whole vocabulary (size 0, or a size that covers it).

    The ids ranked first are the tokenizer's added tokens (end of turn, tool-call markers: what
    a chat turn must be able to draft), then the lowest ids: byte-level BPE and SentencePiece
    vocabularies number their tokens in merge order, most frequent first. `size` is rounded up
    to a multiple of SUBSET_MULTIPLE."""
    size = -(-size // SUBSET_MULTIPLE) * SUBSET_MULTIPLE
    if size <= 0 or size >= vocab_size:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    first = sorted(i for i in added if i < vocab_size)[:size]
    taken = torch.zeros(vocab_size, dtype=torch.bool)
    taken[first] = True
    rest = (~taken).nonzero().squeeze(1)[:size - len(first)]
    taken[rest] = True
    return taken.nonzero().squeeze(1)


def restrict_vocabulary(draft: torch.nn.Module, ids: torch.Tensor) -> None:
    """Cut the draft's output projection down to the rows `ids`, in place: its logits are then
    [tokens, len(ids)], for the tokens `ids` in order. Every kept row keeps its bits."""
    head = draft.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        new = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None,
                              device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(head.weight[ids])
            if head.bias is not None:
                new.bias.copy_(head.bias[ids])
    else:  # a quantized linear (engine/kernels/quant_linear.py)
        new = head.select_rows(ids.to(next(head.buffers()).device))
    draft.set_output_embeddings(new)
