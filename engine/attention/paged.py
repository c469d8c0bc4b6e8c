"""Paged attention for transformers models: our KV cache object and attention function.

Must not touch scheduling: it sees one step's flattened batch (built by the model runner) and
the KV tensors of one model.

How it plugs in: the runner passes a `PagedKVCache` as the model's cache and makes it the
active cache for the forward (`PagedKVCache.step`). transformers calls our registered attention
function (`attn_implementation="specserve_paged"`) in every layer with that layer's new query,
key and value; the function writes the new K/V at `slot_mapping` in the active cache's tensors
of `module.layer_idx` and attends through the block tables. The cache's own `update` writes
nothing: transformers versions call it differently (5.17 without the layer's kwargs, 5.24
with them), so nothing may depend on how. Outside a runner step (a plain forward or `generate`
on the same model) no cache is active and the function falls back to transformers' SDPA path.

The backend is an interface (`AttentionBackend`): `SDPABackend` is plain PyTorch SDPA and runs
on CPU and GPU; a faster GPU backend (flash-attn varlen, FlexAttention, Triton) can be added
behind the same metadata without touching the runner.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.batch import num_new_tokens, tree_paths
from engine.device_io import to_device

_log = logging.getLogger("specserve.engine")

ATTN_IMPLEMENTATION = "specserve_paged"
# Sequences with at most this many new tokens (decode, verification of 1 + k) are batched
# together with padding; longer ones (prefill chunks) run one by one without padding.
SHORT_QUERY_MAX = 16


@dataclass
class SeqSpan:
    """One sequence's slice of the flattened batch."""

    q_start: int  # offset of its first new token in the flattened batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens it attends to (cached + new)
    block_table: list[int]  # covers at least ctx_len tokens
    prompt_len: int | None = None  # rows at positions >= this are generated tokens
    # a token tree in the span's last len(parents) rows (engine/batch.py `Drafts.parents`):
    # `expand_trees` makes each of its nodes a span of its own
    parents: tuple[int, ...] | None = None
    # a tree node's span: its keys from ctx_len - len(tree_keys) on are read at these positions
    # (its ancestors', then its own), those before at their own; ctx_len counts its keys
    tree_keys: tuple[int, ...] | None = None

    def num_blocks(self, block_size: int) -> int:
        """Blocks of its table that hold its keys (a tree node's own slot may lie past
        ctx_len: the nodes before it in the tree take the slots in between)."""
        last = max(self.ctx_len, max(self.tree_keys or (), default=-1) + 1)
        return -(-last // block_size)


def expand_trees(spans: list[SeqSpan]) -> list[SeqSpan]:
    """Each token tree's nodes as one-row spans over their own keys: the committed tokens, then
    their ancestors and themselves in depth order (a node's row, and its key order, are those
    of the same path verified as a chain: every backend gives it the chain's bits). A node of
    depth d sits at the position of the last committed token plus d; its K/V was written at
    that token's position plus 1 + its index. Spans without a tree pass as they are."""
    if all(s.parents is None for s in spans):
        return spans
    out = []
    for s in spans:
        if s.parents is None:
            out.append(s)
            continue
        k = len(s.parents)
        first = s.ctx_len - k  # the position of the tree's first node's slot
        if s.q_len > k:  # the committed tokens' rows
            out.append(SeqSpan(s.q_start, s.q_len - k, first, s.block_table, s.prompt_len))
        for j, path in enumerate(tree_paths(list(s.parents))):
            out.append(SeqSpan(s.q_start + s.q_len - k + j, 1, first + len(path),
                               s.block_table, s.prompt_len,
                               tree_keys=tuple(first + a for a in path)))
    return out


def pack(items: list, drafts, block_size: int
         ) -> tuple[list[int], list[int], list[SeqSpan], list[int], list[int]]:
    """The packed forward of `items` (engine/batch.py `RunItem`s, and their `Drafts`): per
    row its position and K/V slot, per item its attention span, the rows whose logits are
    wanted and each item's first wanted one (row offsets). A token tree's node sits at the
    last committed token's position plus its depth, its K/V in the slot after the nodes
    before it; an item of a proposer's tree node (`tree_keys`) writes its K/V at its last
    key's position."""
    positions, slot_mapping, keep, row_offsets = [], [], [], [0]
    spans = []
    bs, q_start = block_size, 0
    for i, (item, n) in enumerate(zip(items, num_new_tokens(items, drafts))):
        start, end, table = item.start, item.start + n, item.block_table
        tree = drafts.parents_of(i) if drafts is not None else None
        if tree is None:
            positions += range(start, end)
        else:
            base = start + len(item.token_ids) - 1
            positions += range(start, base + 1)
            positions += [base + len(path) for path in drafts.paths_of(i)]
        at = range(start, end) if item.tree_keys is None else item.tree_keys[-1:]
        slot_mapping += [table[p // bs] * bs + p % bs for p in at]
        spans.append(SeqSpan(q_start, n, end, table, item.prompt_len,
                             None if tree is None else tuple(tree), tree_keys=item.tree_keys))
        keep += range(q_start + n - item.num_rows, q_start + n)
        row_offsets.append(row_offsets[-1] + item.num_rows)
        q_start += n
    return positions, slot_mapping, spans, keep, row_offsets


@dataclass
class LongSpan:
    q_start: int  # offset of its first new token in the flattened batch
    q_index: torch.Tensor  # [q_rows] rows of the flattened batch (padded by repeating the last)
    q_len: int  # rows that are real (the first q_len of q_index)
    kv_slots: torch.Tensor | None  # [kv_len] cache slots; None when causal on the new K/V
    mask: torch.Tensor | None  # [q_rows, kv_len] bool, True = attend; None with kv_slots None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    short_q_index: torch.Tensor | None = None  # [B, q_max] rows of the flattened batch (padded)
    short_kv_slots: torch.Tensor | None = None  # [B, kv_max] cache slots (padded with 0)
    short_mask: torch.Tensor | None = None  # [B, 1, q_max, kv_max] bool, True = attend
    short_out: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows of the flattened batch,
    #   their places in the flattened [B * q_max] group output): the real, unpadded rows
    long_spans: list[LongSpan] = field(default_factory=list)
    # rows of generated tokens on the CPU row kernel: (rows of the flattened batch [R],
    # their positions [R], their sequences' block tables [R, blocks], per row the first key
    # read through the next tensor [R] (a tree node's; past the row's keys elsewhere), those
    # keys' positions [R, max tree depth], the block size)
    kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       int] | None = None


@dataclass(frozen=True)
class InvariantLayout:
    """How every attention call is shaped so that a query row's result depends only on its
    query and the keys it attends to (see engine/kernels/batch_invariant.py): keys always from
    position 0, padded with masked keys to a multiple of `kv_multiple` (the kernel then splits
    them into the same blocks whatever the call), and the query rows of a call padded, by
    repeating the last one, to a multiple of `q_multiple` (no query block of the kernel is
    smaller than that)."""

    q_multiple: int
    kv_multiple: int


class AttentionBackend(ABC):
    """Computes attention for one layer from the step's metadata and the layer's cache."""

    @abstractmethod
    def build_metadata(self, spans: list[SeqSpan], slot_mapping: list[int], block_size: int,
                       device: torch.device) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scaling: float) -> torch.Tensor: ...


class SDPABackend(AttentionBackend):
    """PyTorch SDPA. Short queries (decode, verification) run as one padded group; each longer
    query (a prefill chunk) runs alone. Without a `layout` calls are as small as possible (a
    chunk with no past is causal on its new K/V); with one, every call follows it.

    With `row_kernel` (on the CPU, where engine/kernels/csrc/paged_attention.cpp compiles) the
    rows of GENERATED tokens (positions from the span's `prompt_len` on: decode steps, draft
    verification, a preempted sequence's recomputed tokens) run on that kernel instead: it
    reads the keys in place through the block table, without SDPA's gather and its padding to
    the layout's 512 keys. What decides a row's kernel is whether it is a prompt's or a
    generated token, never how the step is composed, and each kernel gives a row bits that do
    not depend on the other rows of its call: batched or alone, plain or speculative, a row's
    output is the same."""

    def __init__(self, layout: InvariantLayout | None = None, row_kernel: bool = False) -> None:
        self.layout = layout
        self.rows_ext = None
        if row_kernel:
            from engine.kernels import cpu_ext

            ext = cpu_ext.load("paged_attention")
            if isinstance(ext, str):
                _log.info("attention of generated tokens runs on SDPA: the CPU row kernel is "
                          "not available (%s)", ext)
            else:
                self.rows_ext = ext

    def _rows(self, n: int) -> int:  # query rows of a call of n real rows
        m = self.layout.q_multiple if self.layout else 1
        return -(-n // m) * m

    def _keys(self, n: int) -> int:  # keys of a call attending to at most n keys
        m = self.layout.kv_multiple if self.layout else 1
        return -(-n // m) * m

    def build_metadata(self, spans, slot_mapping, block_size, device):
        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, torch.long, device))
        spans = expand_trees(spans)
        if self.rows_ext is not None and torch.device(device).type == "cpu":
            spans = self._kernel_rows(meta, spans, block_size)
        short = [s for s in spans if s.q_len <= SHORT_QUERY_MAX]
        for s in spans:
            if s.q_len > SHORT_QUERY_MAX:
                meta.long_spans.append(self._long_span(s, block_size, device))
        if short:
            self._short_group(meta, short, block_size, device)
        return meta

    def _kernel_rows(self, meta: AttentionMetadata, spans: list[SeqSpan],
                     block_size: int) -> list[SeqSpan]:
        """Take the generated tokens' rows out of `spans` for the row kernel; returns what is
        left for SDPA (the prompts' rows)."""
        rest, rows, positions, tables, trees = [], [], [], [], []
        for s in spans:
            start = s.ctx_len - s.q_len  # position of the span's first row
            first = s.ctx_len if s.prompt_len is None else min(max(s.prompt_len, start),
                                                                 s.ctx_len)
            if first > start:  # prompt rows (a tree's nodes are generated tokens)
                assert s.tree_keys is None, "a token tree's node at a prompt's position"
                rest.append(SeqSpan(s.q_start, first - start, first, s.block_table))
            for p in range(first, s.ctx_len):
                rows.append(s.q_start + p - start)
                positions.append(p)
                tables.append(s.block_table)
                trees.append(s.tree_keys or ())
        if rows:
            width = max(len(t) for t in tables)
            padded = np.zeros((len(tables), width), dtype=np.int64)
            for i, t in enumerate(tables):
                padded[i, :len(t)] = t
            depth = max(len(t) for t in trees)
            tree_pos = np.zeros((len(trees), depth), dtype=np.int64)
            tree_from = np.asarray(positions, dtype=np.int64) + 1
            for i, t in enumerate(trees):
                if t:
                    tree_pos[i, :len(t)] = t
                    tree_from[i] -= len(t)
            meta.kernel_rows = (torch.as_tensor(rows, dtype=torch.long),
                                torch.as_tensor(positions, dtype=torch.long),
                                torch.from_numpy(padded), torch.from_numpy(tree_from),
                                torch.from_numpy(tree_pos), block_size)
        return rest

    def _long_span(self, s: SeqSpan, block_size: int, device: torch.device) -> LongSpan:
        rows = self._rows(s.q_len)
        q_index = s.q_start + torch.arange(rows, device=device).clamp(max=s.q_len - 1)
        if s.ctx_len == s.q_len and self.layout is None:
            return LongSpan(s.q_start, q_index, s.q_len, None, None)
        kv_len = self._keys(s.ctx_len)
        q_pos = s.ctx_len - s.q_len + torch.arange(rows, device=device).clamp(max=s.q_len - 1)
        mask = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
        slots = _slots(_padded_tables([s], kv_len, block_size, device), block_size)[0, :kv_len]
        return LongSpan(s.q_start, q_index, s.q_len, slots, mask)

    def _short_group(self, meta: AttentionMetadata, short: list[SeqSpan], block_size: int,
                     device: torch.device) -> None:
        q_max = self._rows(max(s.q_len for s in short))
        kv_max = self._keys(max(s.ctx_len for s in short))
        per_seq = to_device([(s.q_start, s.q_len, s.ctx_len) for s in short], torch.long, device)
        q_start, q_len, ctx_len = per_seq[:, 0], per_seq[:, 1], per_seq[:, 2]  # [B] each
        offs = torch.arange(q_max, device=device)[None, :]  # [1, q_max]
        rows = np.concatenate([s.q_start + np.arange(s.q_len) for s in short])
        places = np.concatenate([i * q_max + np.arange(s.q_len) for i, s in enumerate(short)])
        real = to_device(np.stack([rows, places]), torch.long, device)
        offs = torch.minimum(offs, q_len[:, None] - 1)  # padding repeats the last query
        q_pos = ctx_len[:, None] - q_len[:, None] + offs  # [B, q_max] absolute positions
        k_pos = torch.arange(kv_max, device=device)  # [kv_max]
        meta.short_q_index = q_start[:, None] + offs
        if any(s.tree_keys for s in short):  # a tree node reads its ancestors' slots
            meta.short_kv_slots = to_device(_tree_slots(short, kv_max, block_size),
                                            torch.long, device)
        else:
            tables = _padded_tables(short, kv_max, block_size, device)
            meta.short_kv_slots = _slots(tables, block_size)[:, :kv_max]
        # causal, and hides padding keys: a key at k_pos >= ctx_len is after every query
        meta.short_mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None, :, :]
        meta.short_out = (real[0], real[1])

    def forward(self, query, key, value, k_cache, v_cache, meta, scaling):
        # query: [1, heads, num_tokens, head_dim]; key/value: [1, kv_heads, num_tokens, head_dim]
        # k_cache/v_cache: [num_slots, kv_heads, head_dim]
        q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
        out = torch.empty_like(q)
        if meta.kernel_rows is not None:
            q, out = q.contiguous(), out.contiguous()
            self.rows_ext.paged_attention_rows(out, q, k_cache, v_cache, *meta.kernel_rows,
                                               scaling)
        if meta.short_q_index is not None:
            qs = q[meta.short_q_index].transpose(1, 2)  # [B, heads, q_max, head_dim]
            ks = k_cache[meta.short_kv_slots].transpose(1, 2)  # [B, kv_heads, kv_max, head_dim]
            vs = v_cache[meta.short_kv_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.short_mask,
                                               scale=scaling, enable_gqa=True)
            o = o.transpose(1, 2).flatten(0, 1)  # [B * q_max, heads, head_dim]
            rows, places = meta.short_out
            out[rows] = o[places]
        for span in meta.long_spans:
            rows = span.q_index[:span.q_len]
            if span.kv_slots is None:  # rows are contiguous: the span's new K/V
                new = slice(span.q_start, span.q_start + span.q_len)
                o = F.scaled_dot_product_attention(query[:, :, new], key[:, :, new],
                                                   value[:, :, new], is_causal=True,
                                                   scale=scaling, enable_gqa=True)
            else:
                qs = q[span.q_index].transpose(0, 1)[None]  # [1, heads, q_rows, head_dim]
                ks = k_cache[span.kv_slots].transpose(0, 1)[None]  # [1, kv_heads, kv, head_dim]
                vs = v_cache[span.kv_slots].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask,
                                                   scale=scaling, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)[:span.q_len]
        return out[None]  # [1, num_tokens, heads, head_dim]


def _padded_tables(spans: list[SeqSpan], num_keys: int, block_size: int,
                   device: torch.device) -> torch.Tensor:
    """[B, blocks covering num_keys] block tables, padded with block 0 (keys a mask hides)."""
    n = -(-num_keys // block_size)
    tables = np.zeros((len(spans), n), dtype=np.int64)
    for i, s in enumerate(spans):
        used = s.block_table[:n]
        tables[i, :len(used)] = used
    return to_device(tables, torch.long, device)


def _tree_slots(spans: list[SeqSpan], num_keys: int, block_size: int) -> np.ndarray:
    """[B, num_keys] each span's keys' cache slots in key order (a tree node's: the committed
    tokens', then its path's), on the host; keys past a span's are block 0's (masked)."""
    pos = np.tile(np.arange(num_keys, dtype=np.int64), (len(spans), 1))
    slots = np.zeros((len(spans), num_keys), dtype=np.int64)
    for i, s in enumerate(spans):
        n = min(s.ctx_len, num_keys)
        if s.tree_keys:
            pos[i, s.ctx_len - len(s.tree_keys):s.ctx_len] = s.tree_keys
        table = np.asarray(s.block_table, dtype=np.int64)
        p = pos[i, :n]
        slots[i, :n] = table[p // block_size] * block_size + p % block_size
    return slots


def _slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, num_blocks] block ids -> [B, num_blocks * block_size] cache slots, in position order."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :, None] * block_size + offsets).flatten(1)


class PagedKVCache:
    """One model's KV tensors `[num_blocks + 1, block_size, kv_heads, head_dim]` per layer.

    Passed to the model as its cache; holds the current step's metadata while a forward runs.
    The block after the pool's (`scratch_block`) belongs to no sequence: padding rows of static
    steps write their K/V there.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.scratch_block = num_blocks
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend or SDPABackend()
        self.meta: AttentionMetadata | None = None
        self.layer_calls = 0  # paged attention calls (the runner checks a forward makes them)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @contextmanager
    def step(self, meta: AttentionMetadata):
        """The cache every paged attention layer reads and writes while a forward runs."""
        self.meta = meta
        token = _active.set(self)
        try:
            yield
        finally:
            _active.reset(token)
            self.meta = None

    def flat(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V tensors as [num_slots, kv_heads, head_dim]."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' cache hook: writes nothing (the attention function does, see the
        module docstring)."""
        return key_states, value_states


_active: ContextVar[PagedKVCache | None] = ContextVar("specserve_paged_cache", default=None)


def active_cache() -> PagedKVCache | None:
    """The cache of the forward running in this context (`PagedKVCache.step`), if any."""
    return _active.get()


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, **kwargs):
    """transformers attention function; see the module docstring.
    query: [1, heads, num_tokens, head_dim]; key/value: [1, kv_heads, num_tokens, head_dim]."""
    cache = _active.get()
    if cache is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    k_flat, v_flat = cache.flat(module.layer_idx)
    k_flat.index_copy_(0, cache.meta.slot_mapping, key[0].transpose(0, 1))
    v_flat.index_copy_(0, cache.meta.slot_mapping, value[0].transpose(0, 1))
    cache.layer_calls += 1
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.backend.forward(query, key, value, k_flat, v_flat, cache.meta, scaling), None


def register() -> str:
    """Register the attention (and, for the fallback path, mask) function with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
