"""Logits processing and sampling: pure functions over per-row tensors.

Must not touch sequences or the scheduler: the engine describes each row (one position whose
next token is wanted) by a `RowSpec`, and everything here works on tensors.

`process_logits` is the single definition of the sampling distribution (grammar mask, logit
bias, penalties, temperature, top-k, top-p, min-p). The verifier applies the same function to draft and target
logits, so exactness holds for every sampling setting.

Random draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from
p. A seeded request's noise is position-keyed: the noise of the row that samples its output
position t is drawn from a generator seeded with `keys.noise_key(seed, t)`, a pure function of the
two, so its tokens depend neither on the batch nor on how many drafts earlier steps verified.
Unseeded rows share the engine's stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

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
    logit_bias: list[tuple[int, list[int], list[float]]]  # (row, token ids, biases)
    noise_keys: list[int | None]  # [R]
    greedy_rows: list[bool]  # [R], as `greedy`
    all_greedy: bool
    grammar_rows: torch.Tensor | None = None  # [G] rows under a grammar
    allowed: torch.Tensor | None = None  # [G, V] bool: the tokens the grammar allows there


def build_sampling_tensors(rows: list[RowSpec], vocab_size: int, device: torch.device,
                           allowed: tuple[list[int], torch.Tensor] | None = None
                           ) -> SamplingTensors:
    """`allowed`: the grammar masks of the constrained rows when already computed (row
    indices, [G, V] bool); otherwise they are computed here from each row's `grammar`."""
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    f32 = dict(dtype=torch.float32, device=device)
    any_top_k = any(p.top_k > 0 and not g for p, g in zip(params, greedy))
    any_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy))
    any_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy))
    t = SamplingTensors(
        temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                 **f32),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
                           for p in params],
                           dtype=torch.long, device=device) if any_top_k else None,
        top_p=torch.tensor([p.top_p for p in params], **f32) if any_top_p else None,
        min_p=torch.tensor([p.min_p for p in params], **f32) if any_min_p else None,
        presence=None, frequency=None, repetition=None, output_counts=None, seen=None,
        logit_bias=[(i, list(p.logit_bias), list(p.logit_bias.values()))
                    for i, p in enumerate(params) if p.logit_bias],
        noise_keys=[r.noise_key for r in rows],
        greedy_rows=greedy,
        all_greedy=all(greedy),
    )
    if any(p.has_penalties for p in params):
        _add_penalties(t, rows, vocab_size, device)
    if allowed is not None:
        t.grammar_rows, t.allowed = torch.tensor(allowed[0], device=device), allowed[1]
        return t
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:
        grammars = rows[constrained[0]].grammar.grammars
        t.grammar_rows = torch.tensor(constrained, device=device)
        t.allowed = grammars.allowed([(rows[i].grammar.matcher, rows[i].grammar.pending)
                                      for i in constrained], device)
    return t


def _add_penalties(t: SamplingTensors, rows: list[RowSpec], vocab_size: int,
                   device: torch.device) -> None:
    f32 = dict(dtype=torch.float32, device=device)
    t.presence = torch.tensor([[r.params.presence_penalty] for r in rows], **f32)
    t.frequency = torch.tensor([[r.params.frequency_penalty] for r in rows], **f32)
    t.repetition = torch.tensor([[r.params.repetition_penalty] for r in rows], **f32)
    t.output_counts = torch.zeros(len(rows), vocab_size, **f32)
    t.seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
        t.output_counts[i].index_add_(0, out, torch.ones(len(out), **f32))
        seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, dtype=torch.long,
                            device=device)
        t.seen[i, seen] = True


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Raw logits -> processed logits whose softmax is the sampling distribution.

    logits: [R, V] float32 (not modified). Disallowed tokens get -inf: first what a grammar
    forbids, so that every later step (penalties, temperature, top-k/p) sees the masked
    distribution.
    """
    logits = logits.clone()
    if t.allowed is not None:
        logits[t.grammar_rows] = logits[t.grammar_rows].masked_fill(~t.allowed, float("-inf"))
    for row, token_ids, biases in t.logit_bias:
        logits[row, token_ids] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
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


_keyed_generators: dict[torch.device, torch.Generator] = {}


def keyed_generator(key: int, device: torch.device) -> torch.Generator:
    """A generator in the state `key` defines (one per device, reseeded at each use)."""
    gen = _keyed_generators.get(device)
    if gen is None:
        gen = _keyed_generators[device] = torch.Generator(device=device)
    return gen.manual_seed(key)


def exponential_noise(shape: tuple[int, int], keys: list[int | None], device: torch.device,
                      default: torch.Generator | None) -> torch.Tensor:
    """[R, V] i.i.d. Exp(1); a row with a key draws from the generator that key defines."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if any(key is None for key in keys):
        noise.exponential_(generator=default)
    for row, key in enumerate(keys):
        if key is not None:
            noise[row].exponential_(generator=keyed_generator(key, device))
    return noise


def keyed_uniform(keys: list[int], device: torch.device) -> torch.Tensor:
    """[len(keys)] U(0, 1), one draw from each key's generator."""
    return torch.cat([torch.rand(1, generator=keyed_generator(key, device), device=device)
                      for key in keys])


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
    racing = processed if len(rows) == len(race) else processed[rows]
    probs = torch.softmax(racing, dim=-1)
    noise = exponential_noise(tuple(probs.shape), [t.noise_keys[i] for i in rows],
                              probs.device, default_generator)
    sampled_ids = (probs / noise).argmax(dim=-1)
    if len(rows) == len(race):
        return sampled_ids
    return greedy_ids.index_copy(0, torch.tensor(rows, device=processed.device), sampled_ids)


def logprobs_of(raw_logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]
                ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Log-probabilities of the model (before processing) for the chosen tokens, plus the top N.

    raw_logits: [R, V]; token_ids: [R]; num_top[i] None means row i wants none.
    """
    wanted = [i for i, n in enumerate(num_top) if n is not None]
    result: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(num_top)
    if not wanted:
        return result
    rows = torch.tensor(wanted, device=raw_logits.device)
    logp = torch.log_softmax(raw_logits[rows].float(), dim=-1)  # [W, V]
    chosen = logp.gather(1, token_ids[rows][:, None])[:, 0].tolist()
    k = max(num_top[i] for i in wanted)
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    for j, i in enumerate(wanted):
        n = num_top[i]
        result[i] = (chosen[j], list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())))
    return result
