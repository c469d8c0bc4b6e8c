"""Continuous-batching scheduler. Must not import torch: it moves sequences and counts tokens.

Each step every running sequence catches up towards its committed and draft tokens within one
token budget: a prompt chunk, one decode token, or 1 + k tokens to verify are the same thing
with different counts. When the block pool runs dry, the newest running sequence is preempted
(its blocks freed, recomputed later); a request is never dropped for lack of cache.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # running sequences at once
    max_model_len: int = 2048  # prompt + output tokens of one sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens on

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def num_sample_rows(self) -> int:
        """Positions whose next token is sampled: the last committed token and every draft."""
        seq = self.seq
        if self.end < seq.num_tokens:
            return 0  # a prompt chunk that does not reach the end yet
        return self.end - max(self.start, seq.num_tokens - 1)

    @property
    def token_ids(self) -> list[int]:
        """The committed tokens it computes (its drafts, `num_drafts`, follow them)."""
        return self.seq.token_ids[self.start:self.end]

    @property
    def num_drafts(self) -> int:
        """Draft tokens it computes (and verifies): those that fit the step's budget."""
        return max(self.end - self.seq.num_tokens, 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # -- queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # after a preemption the pool is tight: admit nobody new
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()  # the newest; never one scheduled before index i
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.match_prefix(seq)
            num_computed = len(cached) * bm.block_size
            num_new = min(seq.num_uncomputed_tokens - num_computed, budget)
            if not bm.allocate(seq, num_computed + num_new, cached):
                break
            self.waiting.popleft()
            bm.record_prefix_lookup(seq.num_tokens, num_computed)
            seq.num_computed_tokens = num_computed
            seq.num_draft_computed = 0  # the draft recomputes its own KV, also of shared blocks
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed from its committed tokens later."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0
        seq.num_draft_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- update ----------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, new_token_ids: list[list[int]],
               new_logprobs: list[list | None] | None = None) -> list[Sequence]:
        """Commit the step's tokens (and their logprobs); returns the sequences that got tokens
        or finished.

        `new_token_ids[i]` are the tokens the verifier emitted for `out.scheduled[i]`: the
        accepted draft tokens followed by one sampled token (empty for a prompt chunk that did
        not reach the end of the prompt); `new_logprobs[i]`, when not None, one entry per token.
        Tokens after a stop are dropped with their logprobs. Rejected draft slots are rolled
        back: their KV is simply overwritten later.
        """
        now = time.monotonic()
        changed = []
        for i, (sched, tokens) in enumerate(zip(out.scheduled, new_token_ids)):
            seq = sched.seq
            end, num_committed = sched.end, seq.num_tokens
            seq.num_draft_tokens = 0
            if not tokens:
                seq.num_computed_tokens = end
                self.block_manager.cache_full_blocks(seq)
                continue
            # KV is valid up to the last accepted draft; the final emitted token has none yet.
            seq.num_computed_tokens = min(end, num_committed + len(tokens) - 1)
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._commit(seq, tokens, new_logprobs[i] if new_logprobs else None)
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
            changed.append(seq)
        return changed

    def _commit(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> None:
        """Append tokens (with their logprobs) up to the first that stops the sequence."""
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            reason = self._stop_reason(seq, token)
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                return

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_draft_tokens = 0
