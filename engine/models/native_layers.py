"""A decode or verification step's decoder layers in one C++ call
(engine/kernels/csrc/decode_layers.cpp), for the lean forward (lean_forward.py).

Where: on the CPU, when every projection of every layer is an int4 layer on the VNNI kernel
with q/k/v and gate/up merged, the fused ops run (norms, rotary, SiLU x up), the model is
whole (no tensor-parallel split), and every row of the step is a generated token whose
attention runs on the CPU row kernel (decode steps, drafts' verification, the draft model's
own steps). Elsewhere (prompt chunks, a step mixing prompt and generated rows, bf16 weights,
a GPU) the lean forward's Python loop runs, calling the same functions: the C++ loop calls
them by address (the loaded modules export it), in the Python loop's order, so a row's bits
do not depend on which loop ran its step (tests/test_native_layers.py).

`ENABLED` off (tests, benches) always takes the Python loop.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import cpu_ext, fused
from engine.kernels.quant_linear import Int4Linear, vnni_kernel

ENABLED = True

_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
            ("mlp", "down_proj"))
_EMPTY = torch.empty(0)


@functools.cache
def kernel():
    """The compiled loop, or why there is none (a str)."""
    return cpu_ext.load("decode_layers")


def _addresses(attention_ext) -> list[int] | None:
    ops, int4 = fused.kernel(), vnni_kernel()
    if isinstance(ops, str) or isinstance(int4, str):
        return None
    return [int4.int4_linear_address, ops.rms_norm_address, ops.add_rms_norm_address,
            ops.silu_mul_address, ops.rotary_address, attention_ext.paged_attention_rows_address]


def _layer_tensors(layer: torch.nn.Module) -> list[torch.Tensor] | None:
    """[input norm, post norm, then codes, groups, units, bias of qkv, o, gate_up, down], or
    None where a projection is not a (merged) int4 layer on the VNNI kernel."""
    out = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    for owner, name in _LINEARS:
        lin = getattr(getattr(layer, owner), name, None)
        if not isinstance(lin, Int4Linear) or lin.kernel != "vnni":
            return None
        out += [*lin.vnni_buffers,
                _EMPTY if lin.bias is None else lin.bias]
    return out


def _build(model: torch.nn.Module, attention_ext):
    """The C++ loop over `model`'s layers, or None where it cannot run them."""
    ext, addresses = kernel(), _addresses(attention_ext)
    if isinstance(ext, str) or addresses is None:
        return None
    config = model.config
    layers = model.model.layers[:config.num_hidden_layers]
    attn = layers[0].self_attn
    norms = [m for layer in layers for m in (layer.input_layernorm,
                                             layer.post_attention_layernorm)]
    tensors = [_layer_tensors(layer) for layer in layers]
    same = (len({m.variance_epsilon for m in norms}) == 1
            and len({layer.self_attn.scaling for layer in layers}) == 1
            and all(layer.self_attn.layer_idx == i for i, layer in enumerate(layers)))
    if any(t is None for t in tensors) or not same:
        return None
    heads = config.num_attention_heads
    dims = [heads, config.num_key_value_heads, attn.head_dim, config.intermediate_size]
    if layers[0].self_attn.qkv_proj.out_features != (dims[0] + 2 * dims[1]) * dims[2]:
        return None
    return ext.DecodeLayers(tensors, dims, float(norms[0].variance_epsilon),
                            float(attn.scaling), addresses)


def loop_for(model: torch.nn.Module, cache, reduce) -> object | None:
    """The C++ loop for this forward of `model` over `cache` (the active PagedKVCache), or
    None where the Python loop must run it (see the module docstring)."""
    if not ENABLED or reduce is not None or cache is None or cache.meta is None:
        return None
    meta, ext = cache.meta, getattr(cache.backend, "rows_ext", None)
    if ext is None or meta.kernel_rows is None or meta.short_q_index is not None \
            or meta.long_spans:
        return None
    built = model.__dict__.get("_specserve_native_layers")
    if built is None:
        built = _build(model, ext) or False
        model.__dict__["_specserve_native_layers"] = built
    return built or None


def run(loop, cache, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """The layers over h [T, hidden]: (h, the last layer's output not yet added or None,
    the stream after each layer of `capture` by index)."""
    n = loop.num_layers
    wanted = sorted({i for i in capture if 0 <= i < n})
    h, pending, *after = loop.forward(h, cos, sin, cache.meta.slot_mapping,
                                      *cache.meta.kernel_rows, cache.k[:n], cache.v[:n], wanted)
    cache.layer_calls += n
    return h, pending, dict(zip(wanted, after))
