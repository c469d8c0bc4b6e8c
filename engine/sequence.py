"""One request's state in the engine. Plain Python: must not import torch.

Token accounting (the scheduler counts tokens, not phases):
- `token_ids` are the committed tokens: the prompt followed by the generated output.
- `num_draft_tokens` counts the proposed, not yet verified tokens that follow `token_ids` (the
  speculator holds their ids: a draft model may leave them on the device).
- `num_computed_tokens` counts the leading tokens of the committed tokens and then the drafts
  whose KV is in the cache. Each step the sequence catches up towards all of them; prefill, chunked
  prefill, decode and verification are the same thing with different counts.
"""

from __future__ import annotations

import enum
import time

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.params = params
        # partitions the prefix cache: blocks are shared only between equal salts (tenants)
        self.cache_salt = cache_salt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_draft_tokens = 0
        self.num_computed_tokens = 0
        self.num_draft_computed = 0  # leading tokens whose draft-model KV is valid
        # speculation stats of this request
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_rejections = 0  # verifications that ended in a rejection
        # per speculation method: [drafted, accepted, verifications ending in a rejection,
        # verifications of token trees, their nodes]
        self.spec_methods: dict[str, list[int]] = {}
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full committed blocks
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # structured output: the grammar's state after the committed output (an llguidance
        # LLMatcher), None when the request has no grammar
        self.matcher = None
        self.grammars = None  # the engine's structured-output side that made `matcher`
        # Per generated token: (chosen logprob, [(token id, logprob) ...]) when requested.
        self.output_logprobs: list[tuple[float, list[tuple[int, float]]]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (committed and draft) whose KV is not yet in the cache."""
        return self.num_tokens + self.num_draft_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
