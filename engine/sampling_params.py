"""Per-request sampling settings. Plain Python: must not import torch.

Invalid settings raise `InvalidRequestError` naming the field (`param`), at construction,
before anything is scheduled.

Sampling runs in float32, where 1e-300 is 0: values too small to represent are given a meaning
that needs no such number. A temperature below MIN_TEMPERATURE is greedy; a top_p below
MIN_TOP_P is raised to it, which keeps the same nucleus (the top token alone: its probability is
at least 1 / vocabulary size > MIN_TOP_P); a repetition_penalty below MIN_REPETITION_PENALTY
(dividing logits by it would overflow) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5  # below: greedy (as vLLM's _SAMPLING_EPS)
MIN_TOP_P = 1e-6  # below: the same nucleus as at MIN_TOP_P, the top token alone
MIN_REPETITION_PENALTY = 0.01


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: until eos, a stop token or the context length
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI semantics: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics: over prompt and generated tokens
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; N: chosen token's plus the top N
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # a request may opt out of speculation
    # structured output: an llguidance grammar (engine/structured.py builds them from a JSON
    # schema, a regex, choices or Lark); only tokens it allows are sampled
    grammar: str | None = None
    # Predicted Outputs: the tokens the caller expects the output to be (e.g. the file being
    # edited): a draft source, verified like every draft, so the output does not depend on it
    prediction: list[int] | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                           and self.max_tokens >= 1),
               "max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name,
                   f"must be in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty)
               and self.repetition_penalty >= MIN_REPETITION_PENALTY, "repetition_penalty",
               f"must be >= {MIN_REPETITION_PENALTY}, got {self.repetition_penalty!r}")
        self.top_p = max(self.top_p, MIN_TOP_P)
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and -2 ** 63 <= self.seed < 2 ** 63), "seed",
               f"must be a 64-bit signed integer, got {self.seed!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and token >= 0, "logit_bias",
                       f"keys must be token ids, got {token!r}")
                _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias",
                       f"values must be in [-100, 100], got {bias!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar != ""),
               "grammar", "must be a grammar string")
        _check(self.prediction is None or (isinstance(self.prediction, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prediction)),
               "prediction", "must be a list of token ids")
        _check(not (self.grammar and self.ignore_eos), "ignore_eos",
               "cannot be combined with structured output (the grammar ends the output)")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid sampling parameter {name}: {message}", name)
