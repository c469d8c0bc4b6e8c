"""The forward of Llama-family decoder models (Qwen2, Llama: what the recipes serve) without
transformers' module wrappers. Must not change what a layer computes beyond the fused ops'
stated roundings.

Between the matmuls, on CPUs where engine/kernels/fused.py's ops run (AVX-512, fp32 or bf16),
each RMSNorm (with the residual add before it), the rotary embedding and SiLU x up are one
call each, per row (3.5 ms less per step of the int4 1.5B target, 2.5 of the 0.5B draft, on a
2-core Xeon); they round as torch's ops do but for the norm's sum of squares and SiLU's
exponential (fused.py says how far that moves an output). Elsewhere, and with `fused.ENABLED`
off, it calls the same leaf modules (embeddings, norms, rotary embedding, linear layers, the
activation) and the same `apply_rotary_pos_emb` in the same order as the models' own forward,
so its outputs are bit-identical to theirs (tests/test_lean_forward.py checks it); what it
skips is the per-module `__call__` machinery, the decoder layers' and attention modules'
Python (kwargs plumbing, deprecation wrappers, config attribute lookups) and the mask
building the paged path does not use: measured on the CPU, 1.5-2 ms per forward of the int4
1.5B target (37.6 ms instead of 39.8) and of the int4 0.5B draft (17.8 instead of 19.3).
Attention goes through `paged_attention_forward` as in the models' own forward. Leaf modules'
forwards are called directly, so forward hooks on modules do not run: a runner with hooks to
honour sets `lean = False`. Where native_layers.py can, a step's decoder layers run as one C++
call of the same kernels in the same order (the same bits); elsewhere `_layers` runs them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from engine.attention.paged import active_cache, paged_attention_forward
from engine.kernels import fused
from engine.models import native_layers

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


def merge_projections(model: torch.nn.Module) -> int:
    """Give each layer one projection for q, k and v (`qkv_proj`) and one for gate and up
    (`gate_up_proj`) where its int4 layers merge (`Int4Linear.merged`: each output keeps its
    bits; the separate layers then view the merged weights). One call instead of three and two:
    the activations are quantized once and the kernel's threads start once. Returns the
    projections merged."""
    from engine.kernels.quant_linear import Int4Linear

    merged = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name, parts in ((attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   (mlp, "gate_up_proj", ("gate_proj", "up_proj"))):
            if hasattr(owner, name):
                continue
            one = Int4Linear.merged([getattr(owner, p) for p in parts])
            if one is not None:
                owner.add_module(name, one)
                merged += 1
    return merged


def _fusable(model: torch.nn.Module, h: torch.Tensor) -> bool:
    """Whether this forward's norms, rotary and SiLU x up run as engine/kernels/fused.py's ops:
    on the CPU in fp32 or bf16, for RMSNorms in the activations' dtype and SiLU (rotary where
    the head's half is a multiple of 16, `_fused_rotary`)."""
    config, norm = model.config, model.model.norm
    return (getattr(config, "hidden_act", None) == "silu" and hasattr(norm, "variance_epsilon")
            and norm.weight.dtype == h.dtype
            and fused.usable(h, h.shape[-1], config.intermediate_size))


def _fused_rotary(model: torch.nn.Module) -> bool:
    return model.model.layers[0].self_attn.head_dim % 32 == 0


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """[1, T, F] as a [T, F] matrix of rows of unit stride, as the fused ops take them (a
    linear may return its output column-major)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.view(x.shape[1], x.shape[2])  # (a step may keep no rows: T = 0)


class _Residual:
    """The residual stream of one forward: `h` [1, T, hidden], and a layer's output not yet
    added to it (`pending`), which the fused ops add in the same call as the next norm."""

    def __init__(self, h: torch.Tensor, fast: bool) -> None:
        self.h, self.pending, self.fast = h, None, fast

    def add(self, delta: torch.Tensor) -> None:
        if self.fast:
            self.pending = delta
        else:
            self.h = self.h + delta

    def settle(self) -> torch.Tensor:
        """`h` with every output added."""
        if self.pending is not None:
            self.h, self.pending = self.h + self.pending, None
        return self.h

    def norm(self, module: torch.nn.Module) -> torch.Tensor:
        """`module` (an RMSNorm) of the stream, adding what is pending first."""
        if not self.fast:
            return module.forward(self.h)
        ops, h = fused.kernel(), self.h
        rows = h.shape[1]
        if self.pending is None:
            x = ops.rms_norm(_matrix(h), module.weight, module.variance_epsilon)
        else:
            new, x = ops.add_rms_norm(_matrix(h), _matrix(self.pending), module.weight,
                                      module.variance_epsilon)
            self.h, self.pending = new.view(h.shape), None
        return x.view(h.shape)


def forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
            keep: torch.Tensor | None, capture: tuple[int, ...] = (),
            reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> torch.Tensor | None | tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, len(keep), V] of a paged forward (the runner has made its cache active);
    keep None: no logits (a tensor-parallel rank that does not sample); with `capture` (layer
    indices) also the outputs of those layers at every row, concatenated:
    [T, len(capture) * hidden] (what a draft head reads). `reduce`: a split model's sum over
    ranks of the row-parallel layers' partial outputs (engine/parallel/group.py)."""
    inner = model.model
    h = inner.embed_tokens.forward(input_ids)
    fast = _fusable(model, h)
    rotary = _Rotary(model, *inner.rotary_emb.forward(h, position_ids),
                     fast and _fused_rotary(model))
    stream = _Residual(h, fast)
    cache = active_cache()
    loop = native_layers.loop_for(model, cache, reduce) if rotary.fused else None
    if loop is not None:
        new, pending, captured = native_layers.run(loop, cache, _matrix(h), rotary.cos[0],
                                                   rotary.sin[0], capture)
        stream.h = new.view(h.shape)
        stream.pending = None if pending is None else pending.view(h.shape)
    else:
        captured = _layers(model, stream, rotary, reduce or _whole, capture)
    if keep is None:
        return None
    if fast:  # the norm is per row: the kept rows alone
        stream.h = stream.h[:, keep, :].contiguous()
        if stream.pending is not None:
            stream.pending = stream.pending[:, keep, :].contiguous()
        logits = model.lm_head.forward(stream.norm(inner.norm))
    else:
        h = inner.norm.forward(stream.settle())
        logits = model.lm_head.forward(h[:, keep, :])
    if capture:
        return logits, torch.cat([captured[i] for i in capture], dim=-1)
    return logits


def _layers(model: torch.nn.Module, stream: _Residual, rotary: "_Rotary",
            reduce: Callable[[torch.Tensor], torch.Tensor], capture: tuple[int, ...]
            ) -> dict[int, torch.Tensor]:
    """The decoder layers over `stream`, one op at a time (native_layers.py runs the same ops
    in one C++ call where it can); returns the stream after each layer of `capture`."""
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.model.layers[:model.config.num_hidden_layers]):
        attn = layer.self_attn
        q, k, v = _projections(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                               stream.norm(layer.input_layernorm))
        q, k, v = rotary(q, k, v, attn.head_dim)
        o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
        stream.add(reduce(attn.o_proj.forward(o.reshape(1, q.shape[2], -1).contiguous())))
        mlp = layer.mlp
        gate, up = _projections(mlp, "gate_up_proj", ("gate_proj", "up_proj"),
                                stream.norm(layer.post_attention_layernorm))
        act = (fused.kernel().silu_mul(_matrix(gate), _matrix(up)).view(gate.shape)
               if stream.fast else mlp.act_fn(gate) * up)
        stream.add(reduce(mlp.down_proj.forward(act)))
        if index in capture:
            captured[index] = stream.settle()[0]
    return captured


def _projections(owner: torch.nn.Module, merged: str, parts: tuple[str, ...],
                 x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of `owner`'s projections `parts` of x: one call of the merged projection
    where `merge_projections` made one (views of its output), else one call each."""
    one = getattr(owner, merged, None)
    if one is None:
        return [getattr(owner, p).forward(x) for p in parts]
    return list(one.forward(x).split([getattr(owner, p).out_features for p in parts], dim=-1))


class _Rotary:
    """The rotary embedding of one forward's positions, applied to each layer's q and k:
    fused in place (`fused`) or transformers' `apply_rotary_pos_emb`. Returns q, k, v as
    attention takes them, [1, heads, T, head_dim]."""

    def __init__(self, model: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor,
                 fused_ops: bool) -> None:
        self.cos, self.sin, self.fused = cos, sin, fused_ops
        self.apply = _rotary(type(model).__name__)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
        shape = (1, q.shape[1], -1, head_dim)
        if self.fused:  # in place on the fresh projections, then the same views
            ops = fused.kernel()
            q, k = _matrix(q), _matrix(k)
            ops.rotary_(q, self.cos[0], self.sin[0], head_dim)
            ops.rotary_(k, self.cos[0], self.sin[0], head_dim)
            q, k = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2)
        else:
            q, k = self.apply(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2),
                              self.cos, self.sin)
        return q, k, v.view(shape).transpose(1, 2)
