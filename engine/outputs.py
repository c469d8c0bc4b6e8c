"""What a request gets back from a step: `RequestOutput`, built from its `Sequence`.

Must not change a sequence: it only reads one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    new_token_ids: list[int]  # generated in this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per output token
    text: str | None = None  # filled by generate() when a tokenizer is present
    metrics: dict[str, float] = field(default_factory=dict)
    num_drafted_tokens: int = 0  # speculation: draft tokens verified for this request
    num_accepted_tokens: int = 0  # ... and accepted
    # per speculation method ("draft_model", "suffix", "ngram"): (drafted, accepted,
    # verifications of token trees, their nodes)
    spec_methods: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


def request_output(seq: Sequence, num_emitted: int) -> RequestOutput:
    """The output of `seq` now; `num_emitted`: its output tokens already sent before."""
    outputs = seq.output_token_ids
    return RequestOutput(
        request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, output_token_ids=outputs,
        new_token_ids=outputs[num_emitted:], finished=seq.is_finished,
        finish_reason=seq.finish_reason, num_cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        num_drafted_tokens=seq.num_drafted_tokens, num_accepted_tokens=seq.num_accepted_tokens,
        spec_methods={m: (c[0], c[1], c[3], c[4]) for m, c in seq.spec_methods.items()},
        metrics={"arrival_time": seq.arrival_time,
                 "first_scheduled_time": seq.first_scheduled_time or 0.0,
                 "first_token_time": seq.first_token_time or 0.0,
                 "num_preemptions": seq.num_preemptions})
