"""The keyed uniforms of seeded sampling (`engine/sample/sampler.py keyed_uniforms`) as one
Triton kernel on CUDA: row r, column j is draw j of the SplitMix64 stream that starts at
keys[r] (`engine/sample/keys.py stream_uniform`), computed in uint64 with the same integer bits
and the same exact float conversion as the torch path, in one pass over the output instead of
a dozen elementwise ops. The tests compare the two on the CPU through Triton's interpreter and
on CUDA."""

from __future__ import annotations

import torch

from engine.sample.keys import GOLDEN_GAMMA, MIX1, MIX2, UNIFORM_BITS

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton
    triton = None

BLOCK = 1024


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _keyed_uniforms_kernel(keys_ptr, out_ptr, n, GAMMA: tl.constexpr, MIX1: tl.constexpr,
                               MIX2: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + row).to(tl.uint64)
        x = key + (col.to(tl.uint64) + 1) * GAMMA  # wraps modulo 2^64
        x = (x ^ (x >> 30)) * MIX1
        x = (x ^ (x >> 27)) * MIX2
        x = x ^ (x >> 31)
        u = ((x >> (64 - BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
        tl.store(out_ptr + row.to(tl.int64) * n + col, u, mask=col < n)


def keyed_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys: [R] int64 (each in [0, 2^63)) on the device -> [R, n] float32 uniforms."""
    out = torch.empty((keys.shape[0], n), dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _keyed_uniforms_kernel[(keys.shape[0], triton.cdiv(n, BLOCK))](
            keys, out, n, GAMMA=GOLDEN_GAMMA, MIX1=MIX1, MIX2=MIX2, BITS=UNIFORM_BITS,
            BLOCK=BLOCK)
    return out
