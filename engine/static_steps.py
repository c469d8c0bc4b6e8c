"""Padded static-buffer steps and, on CUDA, CUDA graphs for them.

A step whose sequences all have 1..`tokens_per_seq` new tokens (plain decode, verification of
1 + k drafts, a draft model's single-token steps, short catch-ups) runs in a bucket of
S sequences x Q tokens: S the smallest configured batch size >= the step's sequences, Q the
most new tokens of any of them. Every sequence gets exactly Q rows (its tokens, then padding);
missing sequences are padding. All inputs live in static tensors: token ids, positions, slot
mapping, and the Triton attention metadata (row starts, new tokens, context lengths, block
tables of a fixed width). Padding rows write their K/V to a scratch block no sequence owns and
have no queries the kernel stores; their logits are computed and dropped. Every bucket writes
its logits into one output buffer of the largest bucket's rows, shared by all buckets (a step
runs one bucket and reads its rows before the next), so the captured graphs keep one
[rows, vocab] tensor rather than one per bucket; the graphs share one memory pool for the rest.

Token trees (a tree's verification, a proposer's tree-node forwards) run in buckets of their
own: S x Q rows where every row is a span of one query row over its own keys (a tree node's
keys are the committed tokens and its ancestors, engine/attention/paged.py `expand_trees`; a
chain row's are the tokens before it), with Q the step's most rows per sequence rounded up to a
power of two (up to `tree_tokens`, the largest tree's rows) and S x Q within the rows of the
largest plain bucket, whose output buffer they share. A row's bits are those of the same row in
an eager step (the kernel computes each query row alone over the same key blocks).

On CUDA each bucket is captured once as a CUDA graph (after a warm-up run) and replayed: one
launch for the whole forward instead of hundreds. The same code runs without capture on any
device (`cuda_graphs: static`), which is how the CPU tests cover everything but the capture
and the replay. Longer steps (prompt chunks) run eagerly.

Exactness: a row's bits do not depend on the bucket (the linears follow the batch-invariance
rule over the bucket's rows, and the Triton kernel is invariant by construction), so greedy
output is the same with graphs, without them and eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.device_io import copy_in, to_device
from engine.attention.paged import expand_trees, pack
from engine.batch import input_ids, num_new_tokens

log = logging.getLogger("specserve.engine")


@dataclass
class Bucket:
    seqs: int  # S
    tokens: int  # Q per sequence
    input_ids: torch.Tensor  # [1, S*Q]
    positions: torch.Tensor  # [1, S*Q]
    keep: torch.Tensor  # [S*Q] rows whose logits are computed (all)
    meta: object  # TritonMetadata over static tensors
    graph: object | None = None  # torch.cuda.CUDAGraph
    tree: bool = False  # a token-tree bucket: every row a span of its own


class StaticSteps:
    """The buckets of one model runner (see the module docstring)."""

    def __init__(self, runner, batch_sizes: tuple[int, ...], tokens_per_seq: int,
                 max_blocks_per_seq: int, capture: bool, tree_tokens: int = 0) -> None:
        from engine.attention.triton_backend import SplitRows, TritonBackend, TritonMetadata

        if not isinstance(runner.kv.backend, TritonBackend):
            raise ValueError("static steps (cuda_graphs) need attention_backend triton")
        self.runner = runner
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.tokens_per_seq = tokens_per_seq
        self.rows = self.batch_sizes[-1] * tokens_per_seq  # the largest bucket's (shared out)
        self.tree_tokens = tree_tokens
        self.width = max_blocks_per_seq
        self.capture = capture
        self.scratch_slot = runner.kv.scratch_block * runner.block_size
        self._buckets: dict[tuple[int, int, bool], Bucket] = {}
        self._meta_cls, self._splits_cls = TritonMetadata, SplitRows
        self.kv_split = runner.kv.backend.kv_split  # split-KV: every row may be a partial
        self.pool = None  # the graphs' shared memory pool
        self.out: torch.Tensor | None = None  # [max S*Q, V] every bucket's logits (shared)
        self.hidden_out: torch.Tensor | None = None  # [max S*Q, F] captured layers (shared)
        # [max S*Q, width] the tree buckets' block tables, a row's each (shared: the largest
        # context's table per row would otherwise be kept by every tree bucket)
        self._tree_tables: torch.Tensor | None = None
        self.num_replays = 0
        self.num_static = 0

    @property
    def max_seqs(self) -> int:
        return self.batch_sizes[-1]

    def fits(self, items, drafts=None) -> bool:
        lengths = num_new_tokens(items, drafts)
        if not (0 < len(items) <= self.max_seqs and all(n > 0 for n in lengths)
                and all(-(-max([it.start + n, *(k + 1 for k in it.tree_keys or ())])
                          // self.runner.block_size) <= self.width
                        for it, n in zip(items, lengths))):
            return False
        if not _has_trees(items, drafts):
            return all(n <= self.tokens_per_seq for n in lengths)
        q = self._tree_rows(len(items), max(lengths))
        return q is not None and all(len(it.tree_keys or ()) <= max(q, self.tokens_per_seq)
                                     for it in items)

    def _tree_rows(self, seqs: int, tokens: int) -> int | None:
        """Rows per sequence of the token-tree bucket for `seqs` sequences of at most `tokens`
        rows each (None: none takes them)."""
        if not self.tree_tokens or tokens > self.tree_tokens:
            return None
        size = next(b for b in self.batch_sizes if b >= seqs)
        q = 1 << (tokens - 1).bit_length()
        return q if size * q <= self.rows else None

    def _bucket(self, seqs: int, tokens: int, tree: bool = False) -> Bucket:
        size = next(b for b in self.batch_sizes if b >= seqs)
        key = (size, tokens, tree)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new_bucket(size, tokens, tree)
            if self.capture:
                self._capture(bucket)
        return bucket

    def _new_bucket(self, seqs: int, tokens: int, tree: bool = False) -> Bucket:
        dev, rows = self.runner.device, seqs * tokens
        spans = rows if tree else seqs  # (a tree bucket: a span per row)
        splits = None
        if self.kv_split:  # row r's partial is r, with room for the longest context's splits
            most = -(-self.width * self.runner.block_size // self.kv_split)
            splits = self._splits_cls(
                torch.full((rows,), -1, dtype=torch.int32, device=dev),
                torch.arange(rows, dtype=torch.int32, device=dev),
                torch.arange(0, rows * most, most, dtype=torch.int32, device=dev),
                torch.zeros(rows, dtype=torch.int32, device=dev), rows * most, most)
        # a tree bucket's rows read their keys from tree_from on at tree_pos: a node's path
        # (at most `tokens` nodes), or a proposer's node item's keys (at most 1 + k_max)
        keys = max(tokens, self.tokens_per_seq)
        trees = (torch.zeros(rows, dtype=torch.int32, device=dev),
                 torch.zeros(rows, keys, dtype=torch.int32, device=dev)) if tree else None
        if tree and self._tree_tables is None:
            self._tree_tables = torch.zeros(self.rows, self.width, dtype=torch.int32,
                                            device=dev)
        meta = self._meta_cls(
            slot_mapping=torch.full((rows,), self.scratch_slot, dtype=torch.long, device=dev),
            q_start=torch.arange(0, rows, 1 if tree else tokens, dtype=torch.int32, device=dev),
            q_len=torch.zeros(spans, dtype=torch.int32, device=dev),
            ctx_len=torch.zeros(spans, dtype=torch.int32, device=dev),
            block_tables=(self._tree_tables[:rows] if tree else
                          torch.zeros(spans, self.width, dtype=torch.int32, device=dev)),
            max_q_len=1 if tree else tokens, block_size=self.runner.block_size, splits=splits,
            tree=trees)
        return Bucket(seqs, tokens, torch.zeros(1, rows, dtype=torch.long, device=dev),
                      torch.zeros(1, rows, dtype=torch.long, device=dev),
                      torch.arange(rows, dtype=torch.long, device=dev), meta, tree=tree)

    def _run(self, b: Bucket) -> None:
        """The forward of `b`, its logits copied into the shared output's first S*Q rows."""
        logits, hidden = self.runner.forward(b.input_ids, b.positions, b.keep, b.meta)
        logits = logits[0]
        rows = self.max_seqs * self.tokens_per_seq
        if self.out is None:  # at the first forward, a warm-up (never inside a capture)
            self.out = torch.empty((rows, logits.shape[-1]), dtype=logits.dtype,
                                   device=logits.device)
            if hidden is not None:
                self.hidden_out = torch.empty((rows, hidden.shape[-1]), dtype=hidden.dtype,
                                              device=hidden.device)
        self.out[:logits.shape[0]].copy_(logits)
        if hidden is not None:
            self.hidden_out[:hidden.shape[0]].copy_(hidden)

    def _capture(self, b: Bucket) -> None:
        """Warm up on a side stream, then capture; a bucket that cannot be captured keeps
        running its static buffers without a graph (logged once)."""
        try:
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(b)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._run(b)
            self.pool = graph.pool()
            b.graph = graph
        except Exception as exc:  # noqa: BLE001 - run uncaptured rather than fail the step
            log.warning("CUDA graph capture failed for %d x %d tokens (%s: %s); that bucket "
                        "runs without a graph", b.seqs, b.tokens, type(exc).__name__, exc)
            b.graph = None

    def warm_up(self) -> None:
        """Create (and capture) every bucket now, so no live step pays for a capture; the
        largest first, so that the smaller ones reuse the pool memory it freed."""
        for size in reversed(self.batch_sizes):
            for tokens in range(self.tokens_per_seq, 0, -1):
                self._bucket(size, tokens)
            q = 1 << (self.tree_tokens - 1).bit_length() if self.tree_tokens else 0
            while q and size * q > self.rows:  # (the largest tree bucket of this size)
                q //= 2
            while q:
                self._bucket(size, q, tree=True)
                q //= 2

    def execute(self, items, drafts=None
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Run `items` (and the `Drafts` after their token ids) in their bucket; returns
        (logits [rows wanted, V], row offsets, the captured layers at the new tokens in item
        order or None)."""
        lengths = num_new_tokens(items, drafts)
        if _has_trees(items, drafts):
            return self._execute_tree(items, drafts, lengths)
        b = self._bucket(len(items), max(lengths))
        bs, rows = self.runner.block_size, b.seqs * b.tokens
        pos = np.zeros(rows, dtype=np.int64)
        slots = np.full(rows, self.scratch_slot, dtype=np.int64)
        q_len = np.zeros(b.seqs, dtype=np.int32)
        ctx = np.zeros(b.seqs, dtype=np.int32)
        tables = np.zeros((b.seqs, self.width), dtype=np.int32)
        part_of_row = np.full(rows, -1, dtype=np.int32)
        part_splits = np.zeros(rows, dtype=np.int32)
        wanted, offsets, real = [], [0], []
        for i, (it, n) in enumerate(zip(items, lengths)):
            lo = i * b.tokens
            real += range(lo, lo + n)
            p = np.arange(it.start, it.start + n)
            table = np.asarray(it.block_table[:-(-(it.start + n) // bs)], dtype=np.int64)
            pos[lo:lo + n] = p
            slots[lo:lo + n] = table[p // bs] * bs + p % bs
            q_len[i], ctx[i] = n, it.start + n
            tables[i, :len(table)] = table
            if self.kv_split and it.prompt_len is not None:
                split = lo + np.nonzero(p >= it.prompt_len)[0]
                part_of_row[split] = split
                part_splits[split] = p[split - lo] // self.kv_split + 1
            wanted += range(lo + n - it.num_rows, lo + n)
            offsets.append(offsets[-1] + it.num_rows)
        self._fill(b, items, drafts, pos, slots, q_len, ctx, tables, part_of_row, part_splits)
        return self._replay(b, wanted, real, offsets)

    def _execute_tree(self, items, drafts, lengths: list[int]
                      ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """`execute` for a step with token trees: each row a span of its own, laid out as
        the eager forward lays them out (engine/attention/paged.py `pack`), item i's rows
        from row i x Q on."""
        b = self._bucket(len(items), self._tree_rows(len(items), max(lengths)), tree=True)
        bs, rows = self.runner.block_size, b.seqs * b.tokens
        positions, slot_mapping, spans, keep, offsets = pack(items, drafts, bs)
        at = np.zeros(len(positions), dtype=np.int64)  # each packed row's row in the bucket
        first = 0
        for i, n in enumerate(lengths):
            at[first:first + n] = np.arange(i * b.tokens, i * b.tokens + n)
            first += n
        pos = np.zeros(rows, dtype=np.int64)
        slots = np.full(rows, self.scratch_slot, dtype=np.int64)
        pos[at], slots[at] = positions, slot_mapping
        q_len = np.zeros(rows, dtype=np.int32)
        ctx = np.zeros(rows, dtype=np.int32)
        tables = np.zeros((rows, self.width), dtype=np.int32)
        tree_from = np.zeros(rows, dtype=np.int32)
        tree_pos = np.zeros((rows, b.meta.tree[1].shape[1]), dtype=np.int32)
        part_of_row = np.full(rows, -1, dtype=np.int32)
        part_splits = np.zeros(rows, dtype=np.int32)
        for s in expand_trees(spans):
            keys = s.tree_keys or ()
            table = s.block_table[:s.num_blocks(bs)]
            for j in range(s.q_len):
                r = at[s.q_start + j]
                c = s.ctx_len - s.q_len + 1 + j  # the row's keys (a tree node's: its own)
                q_len[r], ctx[r], tree_from[r] = 1, c, c - len(keys)
                tables[r, :len(table)] = table
                tree_pos[r, :len(keys)] = keys
                if self.kv_split and s.prompt_len is not None and c - 1 >= s.prompt_len:
                    part_of_row[r], part_splits[r] = r, (c - 1) // self.kv_split + 1
        copy_in(b.meta.tree[0], tree_from)
        copy_in(b.meta.tree[1], tree_pos)
        self._fill(b, items, drafts, pos, slots, q_len, ctx, tables, part_of_row, part_splits)
        return self._replay(b, at[keep].tolist(), at.tolist(), offsets)

    def _fill(self, b: Bucket, items, drafts, pos, slots, q_len, ctx, tables, part_of_row,
              part_splits) -> None:
        """The bucket's static inputs for this step."""
        m = b.meta
        b.input_ids.copy_(input_ids(items, drafts, self.runner.device,
                                    lambda i: i * b.tokens, b.seqs * b.tokens))
        for dst, src in ((b.positions[0], pos), (m.slot_mapping, slots),
                         (m.q_len, q_len), (m.ctx_len, ctx), (m.block_tables, tables)):
            copy_in(dst, src)
        if m.splits is not None:
            copy_in(m.splits.part_of_row, part_of_row)
            copy_in(m.splits.part_splits, part_splits)

    def _replay(self, b: Bucket, wanted: list[int], real: list[int], offsets: list[int]
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Run the filled bucket; the logits at `wanted` rows, the captured layers at `real`
        rows (the new tokens in item order)."""
        if b.graph is not None:
            b.graph.replay()
            self.num_replays += 1
        else:
            self._run(b)
        self.num_static += 1
        index = to_device(wanted, torch.long, self.runner.device)
        hidden = None if self.hidden_out is None else \
            self.hidden_out[to_device(real, torch.long, self.runner.device)]
        # copies: the next step overwrites the shared outputs
        return self.out[index].float(), offsets, hidden


def _has_trees(items, drafts) -> bool:
    """A step with token trees: a verification's (`Drafts.parents` is set only where some
    sequence's drafts are not a chain), or a proposer's tree-node rows."""
    return (drafts is not None and drafts.parents is not None) \
        or any(it.tree_keys is not None for it in items)
