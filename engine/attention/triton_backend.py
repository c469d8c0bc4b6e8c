"""Triton paged attention: one kernel over the step's flattened ragged batch.

Per sequence the metadata holds its first row in the flattened batch (`q_start`), its new
tokens (`q_len`: 1 for a decode, 1 + k for a verification, a prompt chunk), the tokens it
attends to (`ctx_len`, cached + new) and its block-table row. One program computes one tile of
`BLOCK_M` new tokens of one sequence for one query head: it reads the sequence's keys and
values straight from the paged cache through its block table (no gather, no padding between
sequences), `BLOCK_N` keys at a time from position 0, causal inside the new tokens, with an
online softmax in float32. GQA of any ratio: query head h reads kv head h // (heads / kv heads).

Batch invariance by construction: a row's result is a function of its own query and its
sequence's keys only. The key loop always starts at position 0 with the same fixed `BLOCK_N`
tiles (never chosen from the batch), each score is a dot product over the head dimension, and
the tiles a row does not attend to (past its position, when the tile's last row attends
further) are fully masked: they add exact zeros and rescale by exactly 1. So a token's output
has the same bits as a decode, inside a verification, inside a prompt chunk or beside any
other sequences. There is no split-KV variant: splitting a long context across programs
would need split sizes fixed per sequence length to stay invariant, and it could not be timed
without a GPU.

Runs wherever Triton runs: CUDA, and on CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, how the tests run it). All metadata are device tensors built once per
step from numpy arrays; the per-layer call launches one kernel.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engine.attention.paged import AttentionBackend, AttentionMetadata, SeqSpan
from engine.device_io import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # the sdpa backend needs no Triton
    triton = None

BLOCK_M = 16  # new tokens per program (a decode uses 1 row of it)
BLOCK_N = 32  # keys per inner step; fixed, so every row reduces its keys the same way
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Triton's CPU interpreter computes tl.dot of bf16/fp16 operands wrongly (3.9: garbage), so
# interpreted runs (the CPU tests) upcast the tiles to float32 before each dot; compiled runs
# use the native half-precision dot.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [T, H, D]; k, v: [slots, KVH, D]
            q_start_ptr, q_len_ptr, ctx_len_ptr, tables_ptr,  # [B], [B], [B], [B, max_blocks]
            scale,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_tb,
            GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(q_len_ptr + seq)
        if tile * BLOCK_M < q_len:
            q_start = tl.load(q_start_ptr + seq)
            ctx_len = tl.load(ctx_len_ptr + seq)
            kv_head = head // GROUP
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_DIM)
            row_ok = offs_m < q_len
            q_pos = ctx_len - q_len + offs_m  # absolute positions of the tile's rows
            q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                        + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            # keys up to the tile's last real row; rows before it mask the rest exactly
            num_keys = tl.minimum(ctx_len - q_len + (tile + 1) * BLOCK_M, ctx_len)
            for start in range(0, num_keys, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                key_ok = offs_n < ctx_len
                block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE,
                                mask=key_ok, other=0)
                slots = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
                k = tl.load(k_ptr + slots[None, :] * stride_kt + kv_head * stride_kh
                            + offs_d[:, None], mask=key_ok[None, :], other=0.0)  # [D, N]
                if UPCAST:
                    k = k.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                s = s * scale
                attend = (offs_n[None, :] <= q_pos[:, None]) & key_ok[None, :]
                s = tl.where(attend, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
                alpha = tl.exp(m_i - m_ref)
                p = tl.exp(s - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + slots[:, None] * stride_kt + kv_head * stride_kh
                            + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
                if UPCAST:
                    v = v.to(tl.float32)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
                     + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


class TritonMetadata(AttentionMetadata):
    """The step's metadata as device tensors (built once per step, read by every layer)."""

    def __init__(self, slot_mapping: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                 ctx_len: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
                 block_size: int) -> None:
        super().__init__(slot_mapping=slot_mapping)
        self.q_start, self.q_len, self.ctx_len = q_start, q_len, ctx_len
        self.block_tables = block_tables  # [B, blocks of the longest context] int32
        self.max_q_len = max_q_len  # sizes the grid (known on the host: no sync)
        self.block_size = block_size


class TritonBackend(AttentionBackend):
    """Paged attention in one Triton kernel per layer (see the module docstring)."""

    def __init__(self) -> None:
        if triton is None:
            raise RuntimeError("attention_backend triton needs the `triton` package")

    def build_metadata(self, spans: list[SeqSpan], slot_mapping: list[int], block_size: int,
                       device: torch.device) -> TritonMetadata:
        n = len(spans)
        width = max(-(-s.ctx_len // block_size) for s in spans)
        per_seq = np.zeros((3, n), dtype=np.int32)
        tables = np.zeros((n, width), dtype=np.int32)
        for i, s in enumerate(spans):
            per_seq[:, i] = (s.q_start, s.q_len, s.ctx_len)
            used = -(-s.ctx_len // block_size)
            tables[i, :used] = s.block_table[:used]
        seq = to_device(per_seq, torch.int32, device)
        return TritonMetadata(to_device(slot_mapping, torch.long, device), seq[0], seq[1],
                              seq[2], to_device(tables, torch.int32, device),
                              max(s.q_len for s in spans), block_size)

    def forward(self, query, key, value, k_cache, v_cache, meta, scaling):
        # query: [1, heads, T, D]; k_cache/v_cache: [slots, kv_heads, D] (this layer's)
        q = query[0].transpose(0, 1)  # [T, heads, D], a view
        num_heads, head_dim = q.shape[1], q.shape[2]
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"triton attention: head_dim {head_dim} not supported; use sdpa")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch = meta.q_len.shape[0]
        grid = (batch, num_heads, triton.cdiv(meta.max_q_len, BLOCK_M))
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.q_start, meta.q_len, meta.ctx_len,
            meta.block_tables, scaling,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            out.stride(0), out.stride(1), meta.block_tables.stride(0),
            GROUP=num_heads // k_cache.shape[1], BLOCK_SIZE=meta.block_size,
            HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=INTERPRETED)
        return out[None]  # [1, T, heads, D]

