"""Paged attention for transformers models: our KV cache object and attention function.

Must not touch scheduling: it sees one step's flattened batch (built by the model runner) and
the KV tensors of one model.

How it plugs in: the runner passes a `PagedKVCache` as the model's cache. Each attention layer
calls `cache.update(key, value, layer_idx, kwargs)`, which writes the new K/V at `slot_mapping`
and leaves the layer's tensors plus the step's `AttentionMetadata` in `kwargs`; transformers then
calls our registered attention function (`attn_implementation="specserve_paged"`) with those
kwargs, and it reads K/V through the block tables. Without them (a plain forward or `generate`
on the same model) the function falls back to transformers' SDPA path.

The backend is an interface (`AttentionBackend`): `SDPABackend` is plain PyTorch SDPA and runs
on CPU and GPU; a faster GPU backend (flash-attn varlen, FlexAttention, Triton) can be added
behind the same metadata without touching the runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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


@dataclass
class LongSpan:
    q_start: int
    q_len: int
    kv_slots: torch.Tensor | None  # [ctx_len]; None when the chunk has no past (causal on new K/V)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None with kv_slots None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    short_q_index: torch.Tensor | None = None  # [B, q_max] rows of the flattened batch (padded)
    short_kv_slots: torch.Tensor | None = None  # [B, kv_max] cache slots (padded with 0)
    short_mask: torch.Tensor | None = None  # [B, 1, q_max, kv_max] bool, True = attend
    short_valid: torch.Tensor | None = None  # [B, q_max] bool, False on padding
    long_spans: list[LongSpan] = field(default_factory=list)
    # ungrouped short queries: (row of the flattened batch, [p + 1] cache slots it attends to)
    lone_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)


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
    """PyTorch SDPA. Short queries (decode, verification) run as one padded group, unless
    `grouped` is False (batch invariance where the group is not invariant, see
    engine/kernels/batch_invariant.py): then each short query row runs alone, repeated to
    `query_rows` rows, over exactly the keys it attends to."""

    def __init__(self, grouped: bool = True, query_rows: int = 1) -> None:
        self.grouped, self.query_rows = grouped, query_rows

    def build_metadata(self, spans, slot_mapping, block_size, device):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device))
        short = [s for s in spans if s.q_len <= SHORT_QUERY_MAX]
        for s in spans:
            if s.q_len > SHORT_QUERY_MAX:
                meta.long_spans.append(self._long_span(s, block_size, device))
        if short and self.grouped:
            self._short_group(meta, short, block_size, device)
        elif short:
            meta.lone_rows = [row for s in short for row in _lone_rows(s, block_size, device)]
        return meta

    @staticmethod
    def _long_span(s: SeqSpan, block_size: int, device: torch.device) -> LongSpan:
        if s.ctx_len == s.q_len:
            return LongSpan(s.q_start, s.q_len, None, None)
        q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=device)
        mask = torch.arange(s.ctx_len, device=device)[None, :] <= q_pos[:, None]
        slots = _slots(torch.tensor([s.block_table], device=device), block_size)[0, :s.ctx_len]
        return LongSpan(s.q_start, s.q_len, slots, mask)

    @staticmethod
    def _short_group(meta: AttentionMetadata, short: list[SeqSpan], block_size: int,
                     device: torch.device) -> None:
        q_max = max(s.q_len for s in short)
        kv_max = max(s.ctx_len for s in short)
        num_blocks = -(-kv_max // block_size)
        tables = [s.block_table[:num_blocks] + [0] * (num_blocks - len(s.block_table[:num_blocks]))
                  for s in short]
        q_start = torch.tensor([s.q_start for s in short], device=device)  # [B]
        q_len = torch.tensor([s.q_len for s in short], device=device)  # [B]
        ctx_len = torch.tensor([s.ctx_len for s in short], device=device)  # [B]
        offs = torch.arange(q_max, device=device)[None, :]  # [1, q_max]
        valid = offs < q_len[:, None]  # [B, q_max]
        offs = torch.minimum(offs, q_len[:, None] - 1)  # padding repeats the last query
        q_pos = ctx_len[:, None] - q_len[:, None] + offs  # [B, q_max] absolute positions
        k_pos = torch.arange(kv_max, device=device)  # [kv_max]
        meta.short_q_index = q_start[:, None] + offs
        meta.short_kv_slots = _slots(torch.tensor(tables, device=device), block_size)[:, :kv_max]
        # causal, and hides padding keys: a key at k_pos >= ctx_len is after every query
        meta.short_mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None, :, :]
        meta.short_valid = valid

    def forward(self, query, key, value, k_cache, v_cache, meta, scaling):
        # query: [1, heads, num_tokens, head_dim]; key/value: [1, kv_heads, num_tokens, head_dim]
        # k_cache/v_cache: [num_slots, kv_heads, head_dim]
        q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
        out = torch.empty_like(q)
        if meta.short_q_index is not None:
            qs = q[meta.short_q_index].transpose(1, 2)  # [B, heads, q_max, head_dim]
            ks = k_cache[meta.short_kv_slots].transpose(1, 2)  # [B, kv_heads, kv_max, head_dim]
            vs = v_cache[meta.short_kv_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.short_mask,
                                               scale=scaling, enable_gqa=True)
            o = o.transpose(1, 2)  # [B, q_max, heads, head_dim]
            out[meta.short_q_index[meta.short_valid]] = o[meta.short_valid]
        for row, kv_slots in meta.lone_rows:
            qs = q[row][None].expand(self.query_rows, -1, -1).transpose(0, 1)[None]
            ks = k_cache[kv_slots].transpose(0, 1)[None]  # [1, kv_heads, p + 1, head_dim]
            vs = v_cache[kv_slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scaling, enable_gqa=True)
            out[row] = o[0, :, 0]
        for span in meta.long_spans:
            rows = slice(span.q_start, span.q_start + span.q_len)
            qs = query[:, :, rows]  # [1, heads, q_len, head_dim]
            if span.kv_slots is None:
                ks, vs = key[:, :, rows], value[:, :, rows]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                                   enable_gqa=True)
            else:
                ks = k_cache[span.kv_slots].transpose(0, 1)[None]  # [1, kv_heads, ctx, head_dim]
                vs = v_cache[span.kv_slots].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask,
                                                   scale=scaling, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out[None]  # [1, num_tokens, heads, head_dim]


def _lone_rows(s: SeqSpan, block_size: int,
               device: torch.device) -> list[tuple[int, torch.Tensor]]:
    slots = _slots(torch.tensor([s.block_table], device=device), block_size)[0]
    first = s.ctx_len - s.q_len  # position of the span's first query
    return [(s.q_start + j, slots[:first + j + 1]) for j in range(s.q_len)]


def _slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, num_blocks] block ids -> [B, num_blocks * block_size] cache slots, in position order."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :, None] * block_size + offsets).flatten(1)


class PagedKVCache:
    """One model's KV tensors `[num_blocks, block_size, kv_heads, head_dim]` per layer.

    Passed to the model as its cache; holds the current step's metadata while a forward runs.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.backend = backend or SDPABackend()
        self.meta: AttentionMetadata | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states/value_states: [1, kv_heads, num_tokens, head_dim]
        assert self.meta is not None, "PagedKVCache used outside a runner step"
        k_flat = self.k[layer_idx].view(-1, *self.k[layer_idx].shape[2:])  # [num_slots, kv_heads, d]
        v_flat = self.v[layer_idx].view(-1, *self.v[layer_idx].shape[2:])
        k_flat.index_copy_(0, self.meta.slot_mapping, key_states[0].transpose(0, 1))
        v_flat.index_copy_(0, self.meta.slot_mapping, value_states[0].transpose(0, 1))
        if kwargs is not None:
            kwargs["specserve_kv"] = (k_flat, v_flat, self.meta, self.backend)
        return key_states, value_states


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, specserve_kv=None, **kwargs):
    """transformers attention function; see the module docstring."""
    if specserve_kv is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    k_flat, v_flat, meta, backend = specserve_kv
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return backend.forward(query, key, value, k_flat, v_flat, meta, scaling), None


def register() -> str:
    """Register the attention (and, for the fallback path, mask) function with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
