"""The element-wise work between a decoder layer's matmuls, fused per row on the CPU: the lean
forward's (engine/models/lean_forward.py) norms, residual adds, rotary embedding and SiLU x up
in one call each instead of 3-10 torch ops (engine/kernels/csrc/fused_ops.cpp, compiled once
per machine like the int4 kernel; CPUs with AVX-512).

What each computes, against the torch ops it replaces (transformers' Qwen2/Llama modules):
- `rotary_` and `silu_mul` round every intermediate to the activations' dtype where torch's
  ops do (q * cos, rotate_half(q) * sin, their sum; silu(g), its product with u). Rotary is
  bit-identical to torch's; SiLU's e^-|x| is our polynomial (relative error ~1e-7), so an
  output can differ from torch's by one rounding of the dtype where torch's exp lands on the
  other side of a rounding boundary.
- `rms_norm` and `add_rms_norm` round like transformers' RMSNorm (the residual sum, the
  normalized row, its product with the weight) but sum the squares in their own order (16
  lanes, then a tree), so the root mean square may differ from torch's in its last fp32 bit;
  the output then differs from torch's by at most one rounding of the dtype (1 ulp of bf16)
  on a few elements.
Each row is computed alone in a fixed order: a row's bits never depend on the batch
(tests/test_fused_ops.py checks it, 1..8 rows, ragged, fp32 and bf16, both model shapes).
So the int4 and bf16 models' outputs on the CPU change by these roundings against
transformers' forward; speculation, batching and the start-up checks compare a forward with
itself, which these ops keep exact.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import cpu_ext

ENABLED = True  # tests and benches compare against torch's ops by turning this off


@functools.cache
def kernel():
    """The compiled ops (engine/kernels/csrc/fused_ops.cpp), or why there are none (a str).
    Compiled without contracting a product and a sum into one FMA: the ops round as torch's."""
    return cpu_ext.load("fused_ops")


def usable(x: torch.Tensor, *widths: int) -> bool:
    """Whether the fused ops run for activations like `x` with these row lengths."""
    return (ENABLED and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and all(w % 16 == 0 for w in widths) and not isinstance(kernel(), str))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen2RMSNorm, LlamaRMSNorm) as torch ops."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q * cos + rotate_half(q) * sin over [..., D] (transformers' apply_rotary_pos_emb)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up
