"""Logits processing and sampling: pure functions over per-row tensors.

Must not touch sequences or the scheduler: the engine describes each row (one position whose
next token is wanted) by a `RowSpec`, and everything here works on tensors.

`process_logits` is the single definition of the sampling distribution (grammar mask, logit
bias, penalties, temperature, top-k, top-p, min-p). The verifier applies the same function to
draft and target logits, so exactness holds for every sampling setting.

Random draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from
p. A seeded request's noise is position-keyed: the noise of the row that samples its output
position t is -log of the uniform stream that starts at `keys.noise_key(seed, t)`, a pure
function of the two, so its tokens depend neither on the batch nor on how many drafts earlier
steps verified. Unseeded rows share the engine's stream.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.device_io import to_device
from engine.kernels import fused, keyed_noise
from engine.sample.keys import GOLDEN_GAMMA, MIX1, MIX2, UNIFORM_BITS
from engine.sampling_params import SamplingParams


class GrammarRow(NamedTuple):
    """A constrained row: the grammar state after the sequence's committed tokens (`matcher`,
    of `grammars`, an engine/structured.py `Grammars`) and then `pending` (drafts before it)."""

    grammars: object
    matcher: object
    pending: list[int]


@dataclass
class RowSpec:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # generated so far (before this row's position)
    noise_key: int | None = None  # seeded requests: `noise_key(seed, position)` of this row
    grammar: GrammarRow | None = None  # structured output: only grammar-valid tokens


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [R] float, 1.0 on greedy rows
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor | None  # [R] long, vocab_size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [R] float; None if no row uses it
    min_p: torch.Tensor | None  # [R] float; None if no row uses it
    presence: torch.Tensor | None  # [R, 1] float; None if no row has penalties
    frequency: torch.Tensor | None  # [R, 1]
    repetition: torch.Tensor | None  # [R, 1]
    output_counts: torch.Tensor | None  # [R, V] float counts of generated tokens
    seen: torch.Tensor | None  # [R, V] bool: token in prompt or output
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids,
    #                                                                      biases), flat
    noise_keys: list[int | None]  # [R]
    greedy_rows: list[bool]  # [R], as `greedy`
    all_greedy: bool
    grammar_rows: torch.Tensor | None = None  # [G] rows under a grammar
    allowed: torch.Tensor | None = None  # [G, V] bool: the tokens the grammar allows there


def build_sampling_tensors(rows: list[RowSpec], vocab_size: int, device: torch.device,
                           allowed: tuple[list[int], torch.Tensor] | None = None,
                           cache: SettingsCache | None = None) -> SamplingTensors:
    """`allowed`: the grammar masks of the constrained rows when already computed (row
    indices, [G, V] bool); otherwise they are computed here from each row's `grammar`.
    `cache`: the caller's settings of recent batch compositions (None: built anew).

    Everything is gathered on the host first and reaches the device in a few copies that do
    not block (engine/device_io.py): no per-row loop launches work on the device."""
    params = [r.params for r in rows]
    settings = (cache or SettingsCache(0)).get(params, vocab_size, device)
    t = SamplingTensors(
        temperature=settings.temperature, greedy=settings.greedy, top_k=settings.top_k,
        top_p=settings.top_p, min_p=settings.min_p,
        presence=None, frequency=None, repetition=None, output_counts=None, seen=None,
        logit_bias=settings.logit_bias,
        noise_keys=[r.noise_key for r in rows],
        greedy_rows=settings.greedy_rows,
        all_greedy=settings.all_greedy,
    )
    if any(p.has_penalties for p in params):
        _add_penalties(t, rows, vocab_size, device)
    if allowed is not None:
        t.grammar_rows, t.allowed = to_device(allowed[0], torch.long, device), allowed[1]
        return t
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:
        grammars = rows[constrained[0]].grammar.grammars
        t.grammar_rows = to_device(constrained, torch.long, device)
        t.allowed = grammars.allowed([(rows[i].grammar.matcher, rows[i].grammar.pending)
                                      for i in constrained], device)
    return t


class _Settings(NamedTuple):
    """The per-row settings tensors of one batch composition (see `SettingsCache`)."""

    params: list[SamplingParams]  # held, so that no other object takes their ids meanwhile
    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    greedy_rows: list[bool]
    all_greedy: bool


SETTINGS_CACHE_SIZE = 32


class SettingsCache:
    """The settings tensors of rows with these params (temperature, greedy, top-k/p, min-p,
    logit bias) of the last `size` batch compositions: a steady batch (the same requests with
    the same number of rows each, step after step) builds and copies them once. A request's
    params do not change once it is admitted; the cache holds the objects it keys by identity,
    so no other object can take their ids while an entry lives. One per caller (the verifier,
    a draft model), never shared between engines."""

    def __init__(self, size: int = SETTINGS_CACHE_SIZE) -> None:
        self.size = size
        # (device, vocabulary, each row's SamplingParams object) -> its settings
        self.entries: OrderedDict[tuple, _Settings] = OrderedDict()

    def get(self, params: list[SamplingParams], vocab_size: int,
            device: torch.device) -> _Settings:
        key = (torch.device(device), vocab_size, *map(id, params))
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit
        settings = _settings(params, vocab_size, device)
        if self.size:
            self.entries[key] = settings
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return settings


def _settings(params: list[SamplingParams], vocab_size: int, device: torch.device) -> _Settings:
    """The settings tensors of rows with these params, built."""
    greedy = [p.greedy for p in params]
    any_top_k = any(p.top_k > 0 and not g for p, g in zip(params, greedy))
    any_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy))
    any_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy))
    # one float copy for every per-row float setting: temperature, top-p, min-p, greedy
    floats = to_device([[1.0 if g else p.temperature for p, g in zip(params, greedy)],
                        [p.top_p for p in params], [p.min_p for p in params], greedy],
                       torch.float32, device)
    settings = _Settings(
        params, temperature=floats[0], greedy=floats[3].bool(),
        top_k=to_device([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                         for p in params], torch.long, device) if any_top_k else None,
        top_p=floats[1] if any_top_p else None,
        min_p=floats[2] if any_min_p else None,
        logit_bias=_logit_bias(params, device), greedy_rows=greedy, all_greedy=all(greedy))
    return settings


def _logit_bias(params: list[SamplingParams], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every row's logit bias as flat (rows, token ids, biases), or None."""
    entries = [(i, token, bias) for i, p in enumerate(params) if p.logit_bias
               for token, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, tokens, biases = zip(*entries)
    index = to_device([rows, tokens], torch.long, device)
    return index[0], index[1], to_device(biases, torch.float32, device)


def _add_penalties(t: SamplingTensors, rows: list[RowSpec], vocab_size: int,
                   device: torch.device) -> None:
    f32 = dict(dtype=torch.float32, device=device)
    settings = to_device([[r.params.presence_penalty, r.params.frequency_penalty,
                           r.params.repetition_penalty] for r in rows], torch.float32, device)
    t.presence, t.frequency, t.repetition = (settings[:, i:i + 1] for i in range(3))
    # every row's generated tokens, then its prompt tokens, as flat (row, token) pairs
    out = _flat_pairs([r.output_token_ids for r in rows])
    pairs = to_device(np.concatenate([out, _flat_pairs([r.prompt_token_ids for r in rows])],
                                     axis=1), torch.long, device)
    n = out.shape[1]
    t.output_counts = torch.zeros(len(rows), vocab_size, **f32)
    t.output_counts.index_put_((pairs[0, :n], pairs[1, :n]), torch.ones(n, **f32),
                               accumulate=True)
    t.seen = t.output_counts > 0
    t.seen[pairs[0, n:], pairs[1, n:]] = True


def _flat_pairs(token_lists: list[list[int]]) -> np.ndarray:
    """[2, total] (row, token) of every token of every row's list."""
    lengths = [len(tokens) for tokens in token_lists]
    return np.stack([np.repeat(np.arange(len(token_lists)), lengths),
                     np.fromiter((x for tokens in token_lists for x in tokens), dtype=np.int64,
                                 count=sum(lengths))])


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Raw logits -> processed logits whose softmax is the sampling distribution.

    logits: [R, V] float32 (not modified). Disallowed tokens get -inf: first what a grammar
    forbids, so that every later step (penalties, temperature, top-k/p) sees the masked
    distribution.
    """
    logits = logits.clone()
    if t.allowed is not None:
        logits[t.grammar_rows] = logits[t.grammar_rows].masked_fill(~t.allowed, float("-inf"))
    if t.logit_bias is not None:
        rows, token_ids, biases = t.logit_bias
        logits.index_put_((rows, token_ids), biases.to(logits.dtype), accumulate=True)
    if t.output_counts is not None:
        # HF repetition penalty over prompt + output: shrink positive logits, grow negative ones.
        penalized = torch.where(logits > 0, logits / t.repetition, logits * t.repetition)
        logits = torch.where(t.seen, penalized, logits)
        # OpenAI presence/frequency penalties over generated tokens.
        logits -= t.frequency * t.output_counts + t.presence * (t.output_counts > 0)
    if t.all_greedy:
        return logits
    logits /= t.temperature[:, None]
    if t.top_k is not None or t.top_p is not None:
        logits = _top_k_top_p(logits, t.top_k, t.top_p)
    if t.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop |= mass_before >= top_p[:, None]  # the best token always stays (mass_before 0)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA, _MIX1, _MIX2 = (_signed(c) for c in (GOLDEN_GAMMA, MIX1, MIX2))
KEYED_ROWS_PER_PASS = 16


@functools.lru_cache(maxsize=8)  # n is a vocabulary size or 1: a few entries per device
def _column_steps(n: int, device: torch.device) -> torch.Tensor:
    """[n] (j + 1) * gamma for j < n: the SplitMix64 increments of a stream's first n draws."""
    return torch.arange(1, n + 1, dtype=torch.int64, device=device) * _GAMMA


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def keyed_uniforms(keys: list[int], n: int, device: torch.device) -> torch.Tensor:
    """[len(keys), n] U(0, 1): row r holds the first n draws of the SplitMix64 stream that
    starts at keys[r] (`keys.stream_uniform` is the same definition in plain Python).

    Up to KEYED_ROWS_PER_PASS rows per set of elementwise ops (int64 arithmetic wraps modulo
    2^64, as SplitMix64 wants), so the integer bits are the same on every device and the cost
    does not grow with a launch per row. On CUDA one Triton kernel computes the same bits in
    one pass (kernels/keyed_noise.py), on an AVX-512 CPU one C++ loop (csrc/fused_ops.cpp)."""
    if torch.device(device).type == "cuda" and keyed_noise.available():
        return keyed_noise.keyed_uniforms(to_device(keys, torch.int64, device), n)
    if torch.device(device).type == "cpu" and fused.ENABLED and not isinstance(
            fused.kernel(), str):  # the same bits, ~30x faster than the ops below
        return fused.kernel().keyed_uniforms(torch.tensor(keys, dtype=torch.int64), n)
    steps = _column_steps(n, torch.device(device))
    out = torch.empty((len(keys), n), dtype=torch.float32, device=device)
    for lo in range(0, len(keys), KEYED_ROWS_PER_PASS):  # bounds the int64 temporaries
        rows = keys[lo:lo + KEYED_ROWS_PER_PASS]
        x = steps[None, :] + to_device(rows, torch.int64, device)[:, None]
        for bits, multiplier in ((30, _MIX1), (27, _MIX2)):
            x ^= _shift(x, bits)
            x *= multiplier
        x ^= _shift(x, 31)
        out[lo:lo + len(rows)] = _shift(x, 64 - UNIFORM_BITS).float().add_(0.5).mul_(
            2.0 ** -UNIFORM_BITS)
    return out


def exponential_noise(shape: tuple[int, int], keys: list[int | None], device: torch.device,
                      default: torch.Generator | None) -> torch.Tensor:
    """[R, V] i.i.d. Exp(1); a row with a key draws -log of its key's uniforms."""
    keyed = [row for row, key in enumerate(keys) if key is not None]
    if len(keyed) == len(keys):
        return keyed_uniforms(keys, shape[1], device).log_().neg_()
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(
        generator=default)
    if keyed:
        noise[to_device(keyed, torch.long, device)] = keyed_uniforms(
            [keys[row] for row in keyed], shape[1], device).log_().neg_()
    return noise


def sample(processed: torch.Tensor, t: SamplingTensors,
           default_generator: torch.Generator | None = None,
           race: list[bool] | None = None) -> torch.Tensor:
    """processed: [R, V] from `process_logits` -> token ids [R] (long).

    Rows race (draw a sample) unless greedy; `race` can restrict that further (the other rows
    take the argmax, which is what a greedy row takes anyway).
    """
    race = [not g for g in t.greedy_rows] if race is None else race
    greedy_ids = processed.argmax(dim=-1)
    rows = [i for i, r in enumerate(race) if r]
    if not rows:
        return greedy_ids
    if len(rows) == len(race):
        racing, index = processed, None
    else:  # a Python list as an index would be copied to the device blocking
        index = to_device(rows, torch.long, processed.device)
        racing = processed.index_select(0, index)
    probs = torch.softmax(racing, dim=-1)
    noise = exponential_noise(tuple(probs.shape), [t.noise_keys[i] for i in rows],
                              probs.device, default_generator)
    sampled_ids = (probs / noise).argmax(dim=-1)
    if index is None:
        return sampled_ids
    return greedy_ids.index_copy(0, index, sampled_ids)


def logprob_tensors(raw_logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model (before processing) on the device: of the chosen tokens
    ([R]) and the top `num_top` ([R, num_top] values and ids) of each row.

    raw_logits: [R, V]; token_ids: [R]. The host reads them with the step's results."""
    logp = torch.log_softmax(raw_logits.float(), dim=-1)  # [R, V]
    chosen = logp.gather(1, token_ids[:, None])[:, 0]
    if num_top > 0:
        top_vals, top_ids = logp.topk(num_top, dim=-1)
    else:
        top_vals, top_ids = logp[:, :0], logp[:, :0].long()
    return chosen, top_vals, top_ids


def logprob_entries(chosen: list[float], top_vals: list[list[float]], top_ids: list[list[int]],
                    num_top: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Host lists from `logprob_tensors` -> per row (logprob, [(token id, logprob)] of its
    top num_top[row])."""
    return [(c, list(zip(ids[:n], vals[:n])))
            for c, vals, ids, n in zip(chosen, top_vals, top_ids, num_top)]
