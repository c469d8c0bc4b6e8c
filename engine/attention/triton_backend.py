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
other sequences.

Split-KV (flash-decoding, `attention_kv_split` keys per split, off by default): a few decode
rows over a long context give the one-split kernel too few programs to fill a GPU, so each
generated token's row (position >= its sequence's prompt length, as `SeqSpan.prompt_len`
says) is computed in splits of `kv_split` keys at fixed absolute boundaries [s * split,
(s + 1) * split): one program per split writes the row's partial (max, sum, weighted values)
in float32, and a second kernel combines the row's splits 0..n-1 in order. The boundaries
depend on the position alone, never on the batch or the step, so the row's bits are the same
in a decode, a verification or a prompt chunk that recomputes it (after a preemption);
prompt rows keep the one-split loop in the split-0 program, so a fresh prompt chunk needs no
partials. Each partial has room for its own splits only. A backend with splits runs every
step through the split build (whole rows too), so no row's bits depend on which build a step
happened to use; a row whose keys fit in one split gets the bits of the one-split loop (its
combine multiplies by exp(0) = 1). Programs whose split holds no key of their tile return
before loading anything.

Runs wherever Triton runs: CUDA, and on CPU through Triton's interpreter
(`TRITON_INTERPRET=1`, how the tests run it). All metadata are device tensors built once per
step from numpy arrays; the per-layer call launches one kernel (two with split rows).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engine.attention.paged import AttentionBackend, AttentionMetadata, SeqSpan, expand_trees
from engine.device_io import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # the sdpa backend needs no Triton
    triton = None

BLOCK_M = 16  # new tokens per program (a decode uses 1 row of it)
BLOCK_N = 32  # keys per inner step; fixed, so every row reduces its keys the same way
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Triton's CPU interpreter computes tl.dot of bf16/fp16 operands wrongly (3.9: garbage), and
# its float32 dot is numpy's matmul, whose BLAS gives a row other bits at another place in the
# tile on some CPUs (measured: AVX2 OpenBLAS): so interpreted runs (the CPU tests) upcast the
# tiles to float32 and multiply as products summed over the shared axis, the same for every
# row; compiled runs use the native dot.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [T, H, D]; k, v: [slots, KVH, D]
            q_start_ptr, q_len_ptr, ctx_len_ptr, tables_ptr,  # [B], [B], [B], [B, max_blocks]
            part_of_row_ptr, part_first_ptr,  # SPLIT > 0: [T] a row's partial; [P] its offset
            m_part_ptr, l_part_ptr, acc_part_ptr,  # SPLIT > 0: [splits, H] (x D) float32
            tree_from_ptr, tree_pos_ptr,  # TREE: [B] first key read at [B, W] positions
            num_splits, num_heads, scale,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_tb,
            stride_tree,
            GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr, SPLIT: tl.constexpr, TREE: tl.constexpr):
        if SPLIT > 0:  # axis 0: sequence x split (axis 0 has room for 2^31 - 1 programs)
            seq = tl.program_id(0) // num_splits
            split = tl.program_id(0) % num_splits
        else:
            seq = tl.program_id(0)
            split = 0
        head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(q_len_ptr + seq)
        if tile * BLOCK_M < q_len:
            q_start = tl.load(q_start_ptr + seq)
            ctx_len = tl.load(ctx_len_ptr + seq)
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = offs_m < q_len
            q_pos = ctx_len - q_len + offs_m  # absolute positions of the tile's rows
            # each row attends keys [lo, row_end): its whole causal range, or (split rows) the
            # part of it inside this program's split
            if SPLIT > 0:
                part = tl.load(part_of_row_ptr + q_start + offs_m, mask=row_ok, other=-1)
                lo = split * SPLIT
                row_end = tl.where(part >= 0, tl.minimum(lo + SPLIT, q_pos + 1),
                                   tl.where(split == 0, q_pos + 1, 0))
            else:
                lo = 0
                row_end = q_pos + 1
            row_end = tl.where(row_ok, row_end, 0)
            hi = tl.max(row_end, 0)  # keys up to the tile's furthest row; the rest mask exactly
            if hi > lo:  # else no row of the tile has a key in this split: nothing to do
                _attend_tile(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, part_of_row_ptr,
                             part_first_ptr, m_part_ptr, l_part_ptr, acc_part_ptr,
                             tree_from_ptr, tree_pos_ptr, num_heads,
                             scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot,
                             stride_oh, stride_tb, stride_tree, seq, head, split, q_start,
                             ctx_len, offs_m, row_ok, row_end, lo, hi, GROUP, BLOCK_SIZE,
                             HEAD_DIM, BLOCK_M, BLOCK_N, IEEE, UPCAST, SPLIT, TREE)

    @triton.jit
    def _attend_tile(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, part_of_row_ptr, part_first_ptr,
                     m_part_ptr, l_part_ptr, acc_part_ptr, tree_from_ptr, tree_pos_ptr,
                     num_heads, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot,
                     stride_oh, stride_tb, stride_tree, seq, head, split, q_start, ctx_len,
                     offs_m, row_ok, row_end, lo, hi, GROUP: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                     SPLIT: tl.constexpr, TREE: tl.constexpr):
        """One tile's online softmax over keys [lo, hi), each row masked to [lo, row_end).
        TREE: a token tree's node (a one-row sequence) reads its keys from tree_from on at
        its path's positions (engine/attention/paged.py `expand_trees`)."""
        kv_head = head // GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < ctx_len
            at = offs_n
            if TREE:
                tree_from = tl.load(tree_from_ptr + seq)
                in_tree = key_ok & (offs_n >= tree_from)
                at = tl.where(in_tree, tl.load(tree_pos_ptr + seq * stride_tree + offs_n
                                               - tree_from, mask=in_tree, other=0), offs_n)
            block = tl.load(tables_ptr + seq * stride_tb + at // BLOCK_SIZE,
                            mask=key_ok, other=0)
            slots = block.to(tl.int64) * BLOCK_SIZE + at % BLOCK_SIZE
            k = tl.load(k_ptr + slots[None, :] * stride_kt + kv_head * stride_kh
                        + offs_d[:, None], mask=key_ok[None, :], other=0.0)  # [D, N]
            if UPCAST:
                s = tl.sum(q[:, :, None] * k.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            attend = offs_n[None, :] < row_end[:, None]
            s = tl.where(attend, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slots[:, None] * stride_kt + kv_head * stride_kh
                        + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
            if UPCAST:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padded row has no key: 0, not 0/0
        whole = row_ok
        if SPLIT > 0:
            part = tl.load(part_of_row_ptr + q_start + offs_m, mask=row_ok, other=-1)
            whole = row_ok & (part < 0) & (offs_m * 0 + split == 0)
            in_part = row_ok & (part >= 0) & (row_end > lo)  # the row has keys here
            first = tl.load(part_first_ptr + part, mask=in_part, other=0)
            at = (first.to(tl.int64) + split) * num_heads + head
            tl.store(m_part_ptr + at, m_i, mask=in_part)
            tl.store(l_part_ptr + at, l_i, mask=in_part)
            tl.store(acc_part_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=in_part[:, None])
        tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
                 + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=whole[:, None])

    @triton.jit
    def _combine_splits_kernel(
            m_part_ptr, l_part_ptr, acc_part_ptr, o_ptr,  # partials [splits, H(, D)]; o [T, H, D]
            part_row_ptr, part_first_ptr, part_splits_ptr,  # [P]: row, first split, splits
            num_heads, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
        p = tl.program_id(0)
        head = tl.program_id(1)
        n = tl.load(part_splits_ptr + p)
        if n > 0:
            row = tl.load(part_row_ptr + p)
            first = tl.load(part_first_ptr + p).to(tl.int64)
            offs_d = tl.arange(0, HEAD_DIM)
            m = tl.load(m_part_ptr + first * num_heads + head)
            for s in range(1, n):
                m = tl.maximum(m, tl.load(m_part_ptr + (first + s) * num_heads + head))
            total = tl.zeros([HEAD_DIM], tl.float32)  # the sum of weights, in every lane
            acc = tl.zeros([HEAD_DIM], tl.float32)
            for s in range(0, n):  # in split order, always
                at = (first + s) * num_heads + head
                w = tl.exp(tl.load(m_part_ptr + at) - m)
                total += tl.load(l_part_ptr + at) * w
                acc += tl.load(acc_part_ptr + at * HEAD_DIM + offs_d) * w
            tl.store(o_ptr + row * stride_ot + head * stride_oh + offs_d,
                     (acc / total).to(o_ptr.dtype.element_ty))


class TritonMetadata(AttentionMetadata):
    """The step's metadata as device tensors (built once per step, read by every layer)."""

    def __init__(self, slot_mapping: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                 ctx_len: torch.Tensor, block_tables: torch.Tensor, max_q_len: int,
                 block_size: int, splits: SplitRows | None = None,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(slot_mapping=slot_mapping)
        self.tree = tree  # token trees' nodes: ([B] first key read at, [B, W] positions)
        self.q_start, self.q_len, self.ctx_len = q_start, q_len, ctx_len
        self.block_tables = block_tables  # [B, blocks of the longest context] int32
        self.max_q_len = max_q_len  # sizes the grid (known on the host: no sync)
        self.block_size = block_size
        self.splits = splits  # split-KV: which rows are split, and into how many


class SplitRows:
    """Split-KV metadata: the rows computed in splits (generated tokens' rows) and where their
    partials go. part_of_row [T] int32: the row's partial index, -1 for a row computed whole;
    part_row, part_first, part_splits [P] int32: each partial's row, the offset of its first
    split in the partial buffers, its splits (position // split + 1; 0 for an unused one);
    total: the buffers' splits (the sum, or the static buckets' fixed room); num_splits: the
    grid's split axis (>= every part_splits)."""

    def __init__(self, part_of_row: torch.Tensor, part_row: torch.Tensor,
                 part_first: torch.Tensor, part_splits: torch.Tensor, total: int,
                 num_splits: int) -> None:
        self.part_of_row, self.part_row = part_of_row, part_row
        self.part_first, self.part_splits = part_first, part_splits
        self.total, self.num_splits = total, num_splits

    @classmethod
    def build(cls, spans: list[SeqSpan], num_rows: int, split: int,
              device: torch.device) -> SplitRows:
        """For `spans`: rows at positions >= their span's prompt length are split; partials in
        row order, each with room for its own splits only."""
        part_of_row = np.full(num_rows, -1, dtype=np.int64)
        rows, splits = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for s in spans:
            if s.prompt_len is None:
                continue
            pos = np.arange(s.ctx_len - s.q_len, s.ctx_len)
            generated = np.nonzero(pos >= s.prompt_len)[0]
            rows.append(s.q_start + generated)
            splits.append(pos[generated] // split + 1)
        part_row, part_splits = np.concatenate(rows), np.concatenate(splits)
        part_of_row[part_row] = np.arange(len(part_row))
        part_first = np.cumsum(part_splits) - part_splits
        t, p = num_rows, len(part_row)
        host = np.concatenate([part_of_row, part_row, part_first, part_splits])
        dev = to_device(host, torch.int32, device)
        return cls(dev[:t], dev[t:t + p], dev[t + p:t + 2 * p], dev[t + 2 * p:],
                   int(part_splits.sum()), int(part_splits.max(initial=1)))


class TritonBackend(AttentionBackend):
    """Paged attention in one Triton kernel per layer (see the module docstring).

    kv_split: 0, or the keys per split of the split-KV variant (a multiple of BLOCK_N)."""

    def __init__(self, kv_split: int = 0) -> None:
        if triton is None:
            raise RuntimeError("attention_backend triton needs the `triton` package")
        if kv_split < 0 or kv_split % BLOCK_N:
            raise ValueError(f"invalid engine config attention_kv_split: {kv_split}; use 0 "
                             f"(off) or a positive multiple of {BLOCK_N}")
        self.kv_split = kv_split

    def build_metadata(self, spans: list[SeqSpan], slot_mapping: list[int], block_size: int,
                       device: torch.device) -> TritonMetadata:
        spans = expand_trees(spans)
        n = len(spans)
        width = max(s.num_blocks(block_size) for s in spans)
        per_seq = np.zeros((3, n), dtype=np.int32)
        tables = np.zeros((n, width), dtype=np.int32)
        for i, s in enumerate(spans):
            per_seq[:, i] = (s.q_start, s.q_len, s.ctx_len)
            used = s.num_blocks(block_size)
            tables[i, :used] = s.block_table[:used]
        seq = to_device(per_seq, torch.int32, device)
        splits = (SplitRows.build(spans, len(slot_mapping), self.kv_split, device)
                  if self.kv_split else None)
        tree = None
        if any(s.tree_keys for s in spans):
            depth = max(len(s.tree_keys or ()) for s in spans)
            tree_pos = np.zeros((n, 1 + depth), dtype=np.int32)  # column 0: the first key
            for i, s in enumerate(spans):
                keys = s.tree_keys or ()
                tree_pos[i, 0] = s.ctx_len - len(keys)
                tree_pos[i, 1:1 + len(keys)] = keys
            both = to_device(tree_pos, torch.int32, device)
            tree = (both[:, 0].contiguous(), both[:, 1:].contiguous())
        return TritonMetadata(to_device(slot_mapping, torch.long, device), seq[0], seq[1],
                              seq[2], to_device(tables, torch.int32, device),
                              max(s.q_len for s in spans), block_size, splits, tree)

    def forward(self, query, key, value, k_cache, v_cache, meta, scaling):
        # query: [1, heads, T, D]; k_cache/v_cache: [slots, kv_heads, D] (this layer's)
        q = query[0].transpose(0, 1)  # [T, heads, D], a view
        num_heads, head_dim = q.shape[1], q.shape[2]
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"triton attention: head_dim {head_dim} not supported; use sdpa")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch = meta.q_len.shape[0]
        tiles = triton.cdiv(meta.max_q_len, BLOCK_M)
        sp = meta.splits if self.kv_split else None
        if sp is not None:  # every step of a split-KV backend runs the split build
            num_splits, num_parts = sp.num_splits, sp.part_row.shape[0]
            # float32 partials; at least one split's room, so that every pointer is valid
            m_part = torch.empty((max(sp.total, 1), num_heads), dtype=torch.float32,
                                 device=q.device)
            l_part = torch.empty_like(m_part)
            acc_part = torch.empty((max(sp.total, 1), num_heads, head_dim),
                                   dtype=torch.float32, device=q.device)
            part_of_row, part_first = sp.part_of_row, sp.part_first
        else:  # the one-split build (the pointers below are never read)
            num_splits, num_parts = 1, 0
            m_part = l_part = acc_part = part_of_row = part_first = out
        tree = meta.tree  # (else unread: any int32 tensors of the step stand in)
        tree_from, tree_pos = tree if tree is not None else (meta.q_len, meta.block_tables)
        _paged_attention_kernel[(batch * num_splits, num_heads, tiles)](
            q, k_cache, v_cache, out, meta.q_start, meta.q_len, meta.ctx_len,
            meta.block_tables, part_of_row, part_first, m_part, l_part, acc_part, tree_from,
            tree_pos, num_splits, num_heads, scaling,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            out.stride(0), out.stride(1), meta.block_tables.stride(0), tree_pos.stride(0),
            GROUP=num_heads // k_cache.shape[1], BLOCK_SIZE=meta.block_size,
            HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            IEEE=q.dtype == torch.float32 or INTERPRETED, UPCAST=INTERPRETED,
            SPLIT=self.kv_split if sp is not None else 0, TREE=tree is not None)
        if num_parts:
            _combine_splits_kernel[(num_parts, num_heads)](
                m_part, l_part, acc_part, out, sp.part_row, sp.part_first, sp.part_splits,
                num_heads, out.stride(0), out.stride(1), HEAD_DIM=head_dim)
        return out[None]  # [1, T, heads, D]
