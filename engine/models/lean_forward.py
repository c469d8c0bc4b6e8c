"""The forward of Llama-family decoder models (Qwen2, Llama: what the recipes serve) without
transformers' module wrappers. Must not change what a layer computes.

It calls the same leaf modules (embeddings, norms, rotary embedding, linear layers, the
activation) and the same `apply_rotary_pos_emb` in the same order as the models' own forward,
so its outputs are bit-identical to theirs (tests/test_lean_forward.py checks it); what it
skips is the per-module `__call__` machinery, the decoder layers' and attention modules'
Python (kwargs plumbing, deprecation wrappers, config attribute lookups) and the mask
building the paged path does not use: measured on the CPU, 1.5-2 ms per forward of the int4
1.5B target (37.6 ms instead of 39.8) and of the int4 0.5B draft (17.8 instead of 19.3).
Attention goes through `paged_attention_forward` as in the models' own forward. Leaf modules'
forwards are called directly, so forward hooks on modules do not run: a runner with hooks to
honour sets `lean = False`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from engine.attention.paged import paged_attention_forward

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def supported(model: torch.nn.Module) -> bool:
    return type(model).__name__ in SUPPORTED


def _whole(x: torch.Tensor) -> torch.Tensor:  # an unsplit model's layer output is whole
    return x


@functools.cache
def _rotary(model_class: str):
    arch = SUPPORTED[model_class]
    return importlib.import_module(f"transformers.models.{arch}.modeling_{arch}"
                                   ).apply_rotary_pos_emb


def forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
            keep: torch.Tensor | None, capture: tuple[int, ...] = (),
            reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> torch.Tensor | None | tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, len(keep), V] of a paged forward (the runner has made its cache active);
    keep None: no logits (a tensor-parallel rank that does not sample); with `capture` (layer
    indices) also the outputs of those layers at every row, concatenated:
    [T, len(capture) * hidden] (what a draft head reads). `reduce`: a split model's sum over
    ranks of the row-parallel layers' partial outputs (engine/parallel/group.py)."""
    reduce = reduce or _whole
    apply_rotary = _rotary(type(model).__name__)
    inner = model.model
    h = inner.embed_tokens.forward(input_ids)
    cos, sin = inner.rotary_emb.forward(h, position_ids)
    tokens = input_ids.shape[1]
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(inner.layers[:model.config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm.forward(h)
        shape = (1, tokens, -1, attn.head_dim)
        q = attn.q_proj.forward(x).view(shape).transpose(1, 2)
        k = attn.k_proj.forward(x).view(shape).transpose(1, 2)
        v = attn.v_proj.forward(x).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
        h = h + reduce(attn.o_proj.forward(o.reshape(1, tokens, -1).contiguous()))
        x = layer.post_attention_layernorm.forward(h)
        h = h + reduce(mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x))
                                             * mlp.up_proj.forward(x)))
        if index in capture:
            captured[index] = h[0]
    if keep is None:
        return None
    h = inner.norm.forward(h)
    logits = model.lm_head.forward(h[:, keep, :])
    if capture:
        return logits, torch.cat([captured[i] for i in capture], dim=-1)
    return logits
