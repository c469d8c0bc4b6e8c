"""Batch-invariant numerics for the target's forward: a row's result never depends on the rows
that share its call. Must not change what a layer computes for a row, only how it is called.

Matmul libraries pick kernels by shape: on the CPU we measured that bf16 `F.linear` gives a row
different bits for M = 1 than for M >= 2 rows on some shapes, and fp32 differs between M = 1,
2-3 and >= 4. Verification runs 1 + k rows where plain decoding runs 1, and a batch runs many,
so without a rule greedy output changes with speculation and batching. The rule, per op:

- linear layers (the vocabulary projection included): every call has between M0 and M1 rows,
  a range of row counts measured to give every row the same bits: fewer rows are padded with
  zero rows, more are split into calls of M1 rows. The autotuned few-row forms of
  engine/kernels/linear.py are never used (they change the reduction with the row count).
- attention: a query row's output must depend only on its own query and the keys it attends
  to, whatever the other queries and sequences in the call. torch's CPU SDPA kernel does that in
  bf16; in fp32 it depends on the number of query rows and on the key length of the call. So
  the grouped short-query path (padded batches of decode / verification queries) is kept only
  if the check below finds it invariant; otherwise every short query row runs alone, repeated
  to `query_rows` rows, over exactly the keys it attends to.
- norms, rotary embeddings, activations, embeddings and logits processing work row by row.

The rule is established by measurement at start-up (`make_batch_invariant`, well under 2 s), on
the machine and dtype at hand. What cannot be made invariant is reported, never assumed: the
engine logs a warning and /metrics says `batch_invariant="false"`.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger("specserve.engine")

CHECK_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts the check compares
LARGE_ROWS = (96, 128, 256)  # ... and beyond the last, for prompt chunks and large batches
ATTENTION_TRIALS = 32  # random draws the attention check compares
VOCAB_CHECK_COLS = 8192  # output features of the vocabulary projection used by the check


@dataclass
class InvarianceReport:
    invariant: bool = True
    # (in, out) -> (M0, M1): row counts of calls that are invariant (None: no such range)
    linear_rows: dict[tuple[int, int], tuple[int, int] | None] = field(default_factory=dict)
    grouped_attention: bool = True  # the padded short-query group is invariant
    query_rows: int = 1  # rows a lone short query is repeated to
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


_measured: dict[tuple, object] = {}  # per process: a shape is measured once


def _once(key: tuple, measure):
    if key not in _measured:
        _measured[key] = measure()
    return _measured[key]


def invariant_row_range(weight: torch.Tensor, seed: int = 0) -> tuple[int, int] | None:
    """(M0, M1): every call of F.linear with M0 <= M <= M1 rows gives each row the same bits,
    wherever the row sits in the call, and a lone row padded with zero rows to M0 keeps its
    bits; None if there is none. Calls outside the range are padded (fewer rows) or split (more
    rows) into it.

    Measured, not assumed: kernel libraries change the kernel, and the order of accumulation,
    with the row count. A different order shows in a bf16 output only where the exact sum
    straddles a rounding boundary (about 3 elements in 10,000 here), so every row count is
    compared over at least ~50,000 output elements of ordinary (normal) inputs.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    anchor = CHECK_ROWS[-1]
    rows = LARGE_ROWS[-1]  # the large calls compare this many rows, the small ones fewer:
    few = min(rows, -(-max(anchor, 50_000 // weight.shape[0]) // anchor) * anchor)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight)

    def calls_of(m: int, upto: int) -> torch.Tensor:  # rows computed in calls of m rows
        return torch.cat([F.linear(x[s:s + m], weight) for s in range(0, upto // m * m, m)])

    with torch.inference_mode():
        ref = calls_of(anchor, rows)

        def same(m: int) -> bool:
            y = calls_of(m, few if m < anchor else rows)
            return torch.equal(y, ref[:y.shape[0]])

        m0 = None
        for m in reversed(CHECK_ROWS):
            if not same(m):
                break
            m0 = m
        if m0 is None:
            return None
        m1 = anchor
        for m in LARGE_ROWS:
            if not same(m):
                break
            m1 = m
        if m0 > 1:  # a lone row padded with zeros to m0 rows
            pad = x.new_zeros(m0 - 1, x.shape[1])
            lone = torch.cat([F.linear(torch.cat([x[r:r + 1], pad]), weight)[:1]
                              for r in range(anchor)])
            if not torch.equal(lone, ref[:anchor]):
                return None
    return m0, m1


def _range_forward(module: torch.nn.Linear, m0: int, m1: int):
    """Every call has between m0 and m1 rows: fewer are padded with zero rows, more are split
    into calls of m1 rows (the last one padded to m0)."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if m0 <= rows <= m1 or rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        parts = []
        for start in range(0, rows, m1):
            part = flat[start:start + m1]
            n = part.shape[0]
            if n < m0:
                part = torch.cat([part, part.new_zeros(m0 - n, part.shape[1])])
            parts.append(F.linear(part, self.weight, self.bias)[:n])
        y = torch.cat(parts) if len(parts) > 1 else parts[0]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return types.MethodType(forward, module)


def make_linears_invariant(model: torch.nn.Module, report: InvarianceReport) -> None:
    """Measure every distinct linear shape of `model` and pad its few-row calls."""
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight.detach()
        key = (weight.shape[1], weight.shape[0])
        if key not in report.linear_rows:
            probe = weight[:VOCAB_CHECK_COLS] if module is head else weight
            found = _once(("linear", *probe.shape, weight.dtype, weight.device),
                          lambda: invariant_row_range(probe))
            report.linear_rows[key] = found
            if found is None:
                report.invariant = False
                report.problems.append(f"linear {key[0]}x{key[1]} ({weight.dtype}): no range "
                                       f"of row counts gives invariant rows")
        found = report.linear_rows[key]
        if found is not None and found != (1, LARGE_ROWS[-1]):
            module.forward = _range_forward(module, *found)


def check_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device, report: InvarianceReport) -> None:
    """Decide the short-query attention path from measurement (see the module docstring)."""
    from engine.attention.paged import SDPABackend

    shape = (num_heads, num_kv_heads, head_dim, dtype, device)
    report.grouped_attention = _once(("grouped", *shape), lambda: _attention_invariant(
        SDPABackend(), *shape))
    if report.grouped_attention:
        return
    for rows in (1, 2, 4, 8, 16):
        if _once(("lone", rows, *shape), lambda: _attention_invariant(
                SDPABackend(grouped=False, query_rows=rows), *shape)):
            report.query_rows = rows
            return
    report.invariant = False
    report.problems.append(f"attention ({dtype}): no query padding gives invariant rows")


def _attention_invariant(backend, num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device) -> bool:
    """One decode query at position 99 (context 100): alone, as row 0 of a verification of
    1 + k rows, and beside other sequences (a longer decode, a verification, a prompt chunk)."""
    from engine.attention.paged import SeqSpan

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:  # softmax needs scores of ordinary size
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    block_size = 16
    k_cache, v_cache = rand(64 * block_size, num_kv_heads, head_dim), rand(
        64 * block_size, num_kv_heads, head_dim)
    query = rand(num_heads, head_dim)  # the row under test
    mine = list(range(0, 16))  # its block table: the same keys in every case

    def run(spans: list[SeqSpan], row: int) -> torch.Tensor:
        num_tokens = sum(s.q_len for s in spans)
        q = rand(num_tokens, num_heads, head_dim)
        q[row] = query
        meta = backend.build_metadata(spans, list(range(num_tokens)), block_size, device)
        kv = rand(1, num_kv_heads, num_tokens, head_dim)
        return backend.forward(q.transpose(0, 1)[None], kv, kv, k_cache, v_cache, meta,
                               head_dim ** -0.5)[0, row]

    for _ in range(ATTENTION_TRIALS):  # differences are rare: many draws of query and keys
        k_cache.copy_(rand(*k_cache.shape))
        v_cache.copy_(rand(*v_cache.shape))
        query.copy_(rand(*query.shape))
        with torch.inference_mode():
            alone = run([SeqSpan(0, 1, 100, mine)], 0)
            cases = [
                run([SeqSpan(0, 5, 104, mine)], 0),  # verification of 4 drafts
                run([SeqSpan(0, 1, 300, list(range(16, 40))), SeqSpan(1, 1, 100, mine)], 1),
                run([SeqSpan(0, 1, 64, list(range(40, 44))), SeqSpan(1, 1, 80, list(range(44, 50))),
                     SeqSpan(2, 3, 102, mine)], 2),
                run([SeqSpan(0, 20, 220, list(range(50, 64))), SeqSpan(20, 1, 100, mine)], 20),
            ]
        if not all(torch.equal(alone, c) for c in cases):
            return False
    return True


def make_batch_invariant(model: torch.nn.Module) -> InvarianceReport:
    """Measure and install the rule on `model` (the target); returns what holds."""
    t0 = time.perf_counter()
    report = InvarianceReport()
    make_linears_invariant(model, report)
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    param = next(model.parameters())
    check_attention(cfg.num_attention_heads, kv_heads, head_dim,
                    model.get_input_embeddings().weight.dtype, param.device, report)
    report.seconds = time.perf_counter() - t0
    if not report.invariant:
        log.warning("the target's forward is not batch-invariant on this machine: %s; greedy "
                    "output may change with batching and speculation",
                    "; ".join(report.problems))
    return report
