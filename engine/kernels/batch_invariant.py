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
  Quantized linears (engine/kernels/quant_linear.py) are measured the same way, through
  their own kernel.
- attention: a query row's output must depend only on its own query and the keys it attends
  to, whatever the other queries and sequences in the call and however its prompt was chunked.
  torch's CPU flash kernel splits a call's keys into blocks of 512 and its queries into blocks
  of 32-256 rows; a key block shorter than 512 or a query block of fewer rows than some minimum
  changes a row's bits (in bf16 and fp32). So every call follows an `InvariantLayout`
  (engine/attention/paged.py): keys from position 0, padded with masked keys to a multiple of
  512, query rows padded to a multiple of the smallest row count measured to hold, and a
  prompt chunk with no past masked like any other instead of running causal on its new keys.
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
from functools import partial

import torch
import torch.nn.functional as F

from engine.attention.paged import InvariantLayout
from engine.kernels.quant_linear import QUANTIZED_LINEARS, stand_in

log = logging.getLogger("specserve.engine")

CHECK_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts the check compares
LARGE_ROWS = (96, 128, 256)  # ... and beyond the last, for prompt chunks and large batches
ATTENTION_TRIALS = 3  # random draws the attention check compares
ATTENTION_CONTEXT = 600  # tokens of the sequence it checks (more than one key block)
ATTENTION_PROMPT = 200  # with split-KV: its prompt (later rows are generated, computed split)
KV_MULTIPLE = 512  # keys of an attention call: torch's CPU flash kernel splits them in 512s
Q_MULTIPLES = (1, 2, 4, 8, 16)  # candidate query-row multiples, the smallest that holds wins
VOCAB_CHECK_COLS = 8192  # output features of the vocabulary projection used by the check


@dataclass
class InvarianceReport:
    invariant: bool = True
    # (in, out, kind) -> (M0, M1): row counts of calls that are invariant (None: no range);
    # kind: "linear", "Int4Linear/<kernel>" or "Int8Linear"
    linear_rows: dict[tuple[int, int, str], tuple[int, int] | None] = field(default_factory=dict)
    attention: InvariantLayout | None = None  # how attention calls are shaped
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


_measured: dict[tuple, object] = {}  # per process: a shape is measured once


def _once(key: tuple, measure):
    key = (*key, torch.get_num_threads())  # kernels may split work by the threads they have
    if key not in _measured:
        _measured[key] = measure()
    return _measured[key]


def invariant_row_range(weight: torch.Tensor, seed: int = 0, op=None) -> tuple[int, int] | None:
    """(M0, M1): every call of F.linear with M0 <= M <= M1 rows gives each row the same bits,
    wherever the row sits in the call, and a lone row padded with zero rows to M0 keeps its
    bits; None if there is none. Calls outside the range are padded (fewer rows) or split (more
    rows) into it.

    Measured, not assumed: kernel libraries change the kernel, and the order of accumulation,
    with the row count. A different order shows in a bf16 output only where the exact sum
    straddles a rounding boundary (about 3 elements in 10,000 here), so every row count is
    compared over at least ~50,000 output elements of ordinary (normal) inputs.

    `op`: the call measured, `F.linear(x, weight)` by default; a quantized layer's matmul
    passes its own (`weight` then only gives the shape, dtype and device).
    """
    op = op or (lambda rows: F.linear(rows, weight))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    anchor = CHECK_ROWS[-1]
    rows = LARGE_ROWS[-1]  # the large calls compare this many rows, the small ones fewer:
    few = min(rows, -(-max(anchor, 50_000 // weight.shape[0]) // anchor) * anchor)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight)

    def calls_of(m: int, upto: int) -> torch.Tensor:  # rows computed in calls of m rows
        return torch.cat([op(x[s:s + m]) for s in range(0, upto // m * m, m)])

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
            lone = torch.cat([op(torch.cat([x[r:r + 1], pad]))[:1] for r in range(anchor)])
            if not torch.equal(lone, ref[:anchor]):
                return None
    return m0, m1


def _range_forward(module: torch.nn.Module, m0: int, m1: int):
    """Every call has between m0 and m1 rows: fewer are padded with zero rows, more are split
    into calls of m1 rows (the last one padded to m0)."""
    quantized = isinstance(module, QUANTIZED_LINEARS)

    def call(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x) if quantized else F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if m0 <= rows <= m1:
            y = call(self, x.reshape(rows, x.shape[-1]))
            return y.reshape(*x.shape[:-1], y.shape[-1])
        flat = x.reshape(rows, x.shape[-1])
        parts = []
        for start in range(0, rows, m1):
            part = flat[start:start + m1]
            n = part.shape[0]
            if n < m0:
                part = torch.cat([part, part.new_zeros(m0 - n, part.shape[1])])
            parts.append(call(self, part)[:n])
        y = torch.cat(parts) if len(parts) > 1 else parts[0]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return types.MethodType(forward, module)


def _measure_quantized(module: torch.nn.Module, probe: torch.Tensor, stand_in_layer: bool
                       ) -> tuple[int, int] | None:
    layer = stand_in(module, probe.shape[0], probe.dtype) if stand_in_layer else module
    return invariant_row_range(probe, op=layer.matmul)


def make_linears_invariant(model: torch.nn.Module, report: InvarianceReport) -> None:
    """Measure every distinct linear shape of `model` and pad its few-row calls."""
    head = model.get_output_embeddings()
    dtype = model.get_input_embeddings().weight.dtype
    for module in model.modules():
        quantized = isinstance(module, QUANTIZED_LINEARS)
        if type(module) is not torch.nn.Linear and not quantized:
            continue
        kind = "linear"
        if quantized:  # "Int4Linear/vnni": the same layer on another kernel is another case
            kind = type(module).__name__ + (f"/{module.kernel}" if hasattr(module, "kernel")
                                            else "")
        key = (module.in_features, module.out_features, kind)
        if key not in report.linear_rows:
            if quantized:  # the layer's own kernel; a stand-in tensor gives shape and dtype
                # (a vocabulary projection: a layer of random codes of its first columns' size)
                big = module is head and module.out_features > VOCAB_CHECK_COLS
                probe = torch.empty(VOCAB_CHECK_COLS if big else module.out_features,
                                    module.in_features, dtype=dtype,
                                    device=next(module.buffers()).device)
                measure = partial(_measure_quantized, module, probe, big)
                # the kernel's reduction does not depend on the values: one layer per shape
                cache_key = (kind, *probe.shape, dtype, probe.device)
            else:
                weight = module.weight.detach()
                probe = weight[:VOCAB_CHECK_COLS] if module is head else weight
                measure = partial(invariant_row_range, probe)
                cache_key = ("linear", *probe.shape, weight.dtype, weight.device)
            found = _once(cache_key, measure)
            report.linear_rows[key] = found
            if found is None:
                report.invariant = False
                report.problems.append(f"{kind} {key[0]}x{key[1]} ({dtype}): no range "
                                       f"of row counts gives invariant rows")
        found = report.linear_rows[key]
        if found is not None and found != (1, LARGE_ROWS[-1]):
            module.forward = _range_forward(module, *found)


def check_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device, report: InvarianceReport,
                    backend: str = "sdpa", kv_split: int = 0) -> None:
    """Pick the attention call layout from measurement (see the module docstring); the
    Triton kernel needs no layout (it is invariant by construction), and is checked as is,
    with its split-KV rows when `kv_split` (the check's sequence then has a prompt of
    ATTENTION_PROMPT tokens: the rows after it are generated and split)."""
    from engine.attention.paged import SDPABackend

    shape = (num_heads, num_kv_heads, head_dim, dtype, device)
    if backend == "triton":
        from engine.attention.triton_backend import TritonBackend

        prompt_len = ATTENTION_PROMPT if kv_split else None
        if not _once(("attention", "triton", kv_split, *shape),
                     lambda: _attention_invariant(TritonBackend(kv_split), *shape,
                                                  prompt_len)):
            report.invariant = False
            report.problems.append(f"attention ({dtype}): the triton kernel's rows differ")
        return
    for q_multiple in Q_MULTIPLES:
        layout = InvariantLayout(q_multiple, KV_MULTIPLE)
        if _once(("attention", layout, *shape),
                 lambda: _attention_invariant(SDPABackend(layout), *shape)):
            report.attention = layout
            return
    report.invariant = False
    report.problems.append(f"attention ({dtype}): no call layout gives invariant rows")


def _attention_invariant(backend, num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device,
                         prompt_len: int | None = None) -> bool:
    """Every row of one sequence of ATTENTION_CONTEXT tokens, computed as one whole prompt, must
    have the same bits as when it is computed as a decode, inside a verification, inside a
    prompt chunk with a past, and beside other sequences (the same sequence at other
    positions, which is as good a neighbour as any and needs no second cache)."""
    from engine.attention.paged import SeqSpan

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:  # softmax needs scores of ordinary size
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    n, block_size = ATTENTION_CONTEXT, 16
    table = list(range(-(-n // block_size)))

    def run(spans: list[tuple[int, int]]) -> tuple[list[int], torch.Tensor]:
        """spans: (first position, new tokens); the positions computed and their outputs."""
        positions = [p for first, q_len in spans for p in range(first, first + q_len)]
        seq_spans, start = [], 0
        for first, q_len in spans:
            seq_spans.append(SeqSpan(start, q_len, first + q_len, table, prompt_len))
            start += q_len
        meta = backend.build_metadata(seq_spans, positions, block_size, device)
        idx = torch.tensor(positions, device=device)
        out = backend.forward(q[idx].transpose(0, 1)[None], k_cache[idx].transpose(0, 1)[None],
                              v_cache[idx].transpose(0, 1)[None], k_cache, v_cache, meta,
                              head_dim ** -0.5)
        return positions, out[0]

    decode_at = list(range(3, n, n // 16))
    layouts = [
        [(p, 1) for p in decode_at],  # decodes
        [(p, 5) for p in decode_at[:-1]],  # verifications of 4 drafts
        [(p, q) for p, q in zip(decode_at, (1, 3, 16, 2, 9, 1, 5, 12) * 2)],  # mixed
        [(0, 17), (17, 33), (50, 65), (115, 100), (215, 257), (472, n - 472)],  # prompt chunks
        [(n - 33, 33)] + [(p, 1) for p in decode_at],  # a chunk beside decodes
    ]
    for _ in range(ATTENTION_TRIALS):
        q = rand(n, num_heads, head_dim)
        slots = len(table) * block_size
        k_cache = rand(slots, num_kv_heads, head_dim)
        v_cache = rand(slots, num_kv_heads, head_dim)
        with torch.inference_mode():
            _, whole = run([(0, n)])
            for spans in layouts:
                positions, out = run(spans)
                if not torch.equal(out, whole[positions]):
                    return False
    return True


def make_batch_invariant(model: torch.nn.Module, attention: str = "sdpa",
                         kv_split: int = 0) -> InvarianceReport:
    """Measure and install the rule on `model` (the target); returns what holds.
    `attention`: the attention backend the model runs with (sdpa | triton), `kv_split` its
    split-KV keys per split (triton; 0: off)."""
    t0 = time.perf_counter()
    report = InvarianceReport()
    make_linears_invariant(model, report)
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    param = next(model.parameters())
    check_attention(cfg.num_attention_heads, kv_heads, head_dim,
                    model.get_input_embeddings().weight.dtype, param.device, report, attention,
                    kv_split)
    report.seconds = time.perf_counter() - t0
    if not report.invariant:
        log.warning("the target's forward is not batch-invariant on this machine: %s; greedy "
                    "output may change with batching and speculation",
                    "; ".join(report.problems))
    return report
