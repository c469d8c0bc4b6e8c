"""Structured output: decoding constrained by a grammar (JSON schema, regex, choice, Lark).

A request's `SamplingParams.grammar` is an llguidance grammar, built by the helpers below. The
engine keeps one `LLMatcher` per constrained sequence, advanced over its committed tokens only.
Every row that samples a position of that sequence (plain decoding, each of the 1 + k
verification rows, each draft-model step) gets the mask of the grammar state after the tokens
before it (committed + the drafts before the row): the sampling distribution is the
grammar-masked one, for the target and the draft alike, so speculation stays exact.

Why llguidance rather than xgrammar: a self-contained wheel with no dependencies (xgrammar
requires torch, triton and transformers of its own choosing, which fights our pinned CPU
torch), masks computed on the CPU in tens of microseconds with no per-grammar compilation step
(a new JSON schema per request costs nothing up front), wide JSON-schema coverage that names
what it does not implement (so we can refuse it with a 400), Lark grammars that embed JSON
schemas (tool calls), and rollback for speculation. vLLM, SGLang and llama.cpp use it too.
"""

from __future__ import annotations

import json
import time

import torch

from engine.device_io import to_device
from engine.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)
# JSON is written with Python's json.dumps separators and no other whitespace: flexible
# whitespace lets a model pad forever with newlines before it closes the document
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema(schema: dict | bool | None) -> str:
    """The grammar of JSON documents valid under `schema` (None: any JSON object)."""
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         overrides=JSON_OPTIONS)


def regex(pattern: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    """Exactly one of `options`."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(o) for o in options))


def lark(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


class Grammars:
    """The engine's grammar side: the tokenizer view llguidance needs, matchers, masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size  # the model's logits; the tokenizer may have more ids,
        self._mask_size = max(vocab_size, len(tokenizer))  # which the model never produces
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self._mask_size,
                                                      eos_token=sorted(eos_token_ids))
        self.eos_token_ids = sorted(eos_token_ids)
        self.mask_seconds = 0.0  # time spent computing masks (a metric)
        self._exec = None  # llguidance's thread pool, made on first use

    def check(self, grammar: str) -> None:
        """Refuse a grammar llguidance cannot build (an invalid or unsupported schema)."""
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(f"invalid grammar: {'; '.join(messages)}", "grammar")

    def matcher(self, grammar: str):
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid grammar: {matcher.get_error()}", "grammar")
        return matcher

    def allowed(self, rows: list[tuple[object, list[int]]], device: torch.device
                ) -> torch.Tensor:
        """[len(rows), V] bool: the tokens each row may take. A row is (matcher, pending): the
        grammar state after the matcher's committed tokens and then `pending` (drafts before
        the row). Matchers are left as they were.

        The 1 + k rows of a verification (pending = [], [d1], [d1, d2], ...) are one job for
        llguidance's executor, which computes all of a step's masks in parallel threads without
        the GIL; a lone row with pending drafts (a draft model's step) advances its matcher,
        computes the mask and rolls back."""
        started = time.perf_counter()
        words = (self._mask_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        plain, jobs, lone = [], [], []
        i = 0
        while i < len(rows):
            matcher, pending = rows[i]
            j = i + 1  # rows i..j-1 verify the drafts of row j-1, one more each
            while (not pending and j < len(rows) and rows[j][0] is matcher
                   and len(rows[j][1]) == j - i and rows[j][1][:-1] == rows[j - 1][1]):
                j += 1
            if pending:
                lone.append(i)
            elif j == i + 1:
                plain.append((matcher, i))
            else:
                jobs.append((matcher, i, list(rows[j - 1][1])))
            i = j
        if plain:
            self._executor().unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4,
                                                     len(rows))
        if jobs:
            self._executor().unsafe_compute_mask_ptr_with_draft_token(
                jobs, bitmask.data_ptr(), words * 4, len(rows))
        for i in lone:
            matcher, pending = rows[i]
            consumed = matcher.validate_tokens(pending)
            matcher.consume_tokens(pending[:consumed])
            if consumed == len(pending) and not matcher.is_error():
                matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
            if consumed:
                matcher.rollback(consumed)
        allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().flatten(1)[:, :self.vocab_size]
        # a row after a draft the grammar refuses is never used (that draft is rejected
        # first), nor is an errored matcher's; all-False would make no distribution: allow EOS
        empty = ~allowed.any(dim=1)
        if empty.any():
            allowed[empty.nonzero()[:, 0][:, None], torch.tensor(self.eos_token_ids)] = True
        self.mask_seconds += time.perf_counter() - started
        return to_device(allowed, torch.bool, device)

    def _executor(self):
        if self._exec is None:
            self._exec = self._llg.LLExecutor()
        return self._exec
