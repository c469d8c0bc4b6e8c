"""What the engine can run of a request, checked without the engine: token ids inside the
vocabulary, the prompt plus max_tokens inside the context, a grammar that compiles. The engine
checks every request it is given; a server whose engine runs in another process checks them
again itself, with the same function, to answer a 400 without a round trip.

Sampling ranges are checked when `SamplingParams` is built. Must not know about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int, grammars: Callable[[], object]) -> None:
    """Raise InvalidRequestError naming the field the engine cannot run; `grammars()` gives the
    structured-output checker (engine.structured.Grammars), asked for only when needed."""
    vocab, context = vocab_size, max_model_len
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    if len(prompt_ids) >= context:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens, but the context length is {context} "
            f"(the prompt plus at least one new token)", "prompt", "context_length_exceeded")
    room = context - len(prompt_ids)
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens is {params.max_tokens}, but only {room} tokens fit after the "
            f"{len(prompt_ids)}-token prompt (context {context})", "max_tokens",
            "context_length_exceeded")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    if params.grammar is not None:
        grammars().check(params.grammar)
