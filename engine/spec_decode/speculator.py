"""Speculation inside the engine step: choose k, propose drafts, keep each request's state.

Must not schedule or verify. The engine calls the same hooks every step whether speculation is
on or not (`NoSpeculation` does nothing in each, so speculation off is a true plain step):
`drop` sequences that left the running set (preempted or finished), `take` the drafts the
scheduled sequences verify (one `Drafts` for the step), `observe` the target pass and its
verifications, `propose` after the scheduler committed the step's tokens (told when the step
began, so that the step's whole cost, proposal included, is what its realized rate counts).

A request's speculation state between steps is one `SpecState` here: its pending drafts (on the
host, or on the device only), their q, the method that proposed them and the acceptance
estimate they were chosen on. The `Sequence` only counts its pending drafts
(`num_draft_tokens`, for the scheduler's budget).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SpeculativeConfig
from engine.batch import Drafts, StepLogits
from engine.model_runner import ModelRunner
from engine.runner_plan import RunnerPlan
from engine.sample.row_spec import by_pick
from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats, KController, RealizedRates
from engine.spec_decode.calibration import calibrate
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleHead
from engine.spec_decode.eagle_proposer import EagleProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.suffix import SuffixCache, SuffixDraft

# a step whose drafts come after more tokens than a steady run leaves the draft model behind
# (the bonus token, and the last draft when all were accepted) includes a catch-up
CATCH_UP_TOKENS = 2
OUTPUT_ALPHA = 0.1  # weight of a finished request's output length in the running mean
# a catch-up of the draft model that no measured saving justifies (exploring where speculation
# measured slower, or where it has not been measured yet) may take at most this share of the
# time since the last catch-up; the sequences behind otherwise speculate without the draft model
UNPROVEN_CATCH_UP_SHARE = 0.03


@dataclass
class SpecState:
    """One request's speculation between steps."""

    drafts: list[int] | None = None  # pending drafts on the host (None: none, or `device`)
    device: torch.Tensor | None = None  # [k] pending drafts that only the device holds
    q: torch.Tensor | None = None  # [k, V] their draft probabilities (None: one-hot)
    method: tuple[str, int] | None = None  # (method, suffix match length) of the pending drafts
    acceptance: float | None = None  # the estimate its last drafts were chosen on


class NoSpeculation:
    """Speculation off (or a request opted out everywhere): every hook is a no-op."""

    enabled = False
    stats: SpecDecodeStats | None = None

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        pass

    def take(self, seqs: list[Sequence], num_drafts: list[int]) -> Drafts | None:
        return None

    def observe(self, target_tokens: int, target_seqs: int, seconds: float | None,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        pass

    def propose(self, running: list[Sequence], num_joining: int,
                step_started: float | None = None) -> None:
        pass

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      step: StepLogits) -> None:
        pass


class Speculator(NoSpeculation):
    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None,
                 max_model_len: int, max_num_batched_tokens: int, device: torch.device,
                 suffix: SuffixCache | None = None) -> None:
        """device: the target's (where each step's drafts go)."""
        self.config = config
        self.device = device
        self.coupled = config.verification == "coupled"
        self.proposer = proposer  # the draft model or prompt lookup; None: suffix only
        self.suffix = suffix  # suffix and hybrid
        self.method = ("eagle" if config.uses_head else "ngram" if config.method == "ngram"
                       else "draft_model")  # the proposer's
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.controller = KController(config.k_max, config.adaptive,
                                      draft_cost_free=config.method == "ngram")
        k_stats = max(config.k_max, config.suffix_max_spec_tokens if suffix else 0)
        self.stats = SpecDecodeStats(k_max=k_stats)
        self._states: dict[str, SpecState] = {}  # request id -> its speculation
        self._unread: Proposal | None = None  # the last proposal, its forwards not timed yet
        self.realized = RealizedRates()
        self._propose_seconds = 0.0  # the last propose call (paid by the step that verifies)
        self._catch_up: list[int] = []  # the last proposal's drafting sequences' backlogs
        self._sample: tuple[int, bool, int, float] | None = None  # the step's, to be timed
        self._mean_output: float | None = None  # output tokens of recently finished requests
        self._since_catch_up = math.inf  # seconds of steps since a draft model catch-up

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        """Forget the speculation of sequences that left the running set (a preempted one is
        recomputed from its committed tokens; a finished one's text joins the suffix cache)."""
        for seq in seqs:
            self._states.pop(seq.request_id, None)
            if finished and seq.finish_reason != "abort":
                n = seq.num_output_tokens
                self._mean_output = n if self._mean_output is None else \
                    self._mean_output + OUTPUT_ALPHA * (n - self._mean_output)
            if self.proposer is not None:  # (a preempted one is recomputed)
                self.proposer.forget(seq)
            if finished and self.suffix is not None:
                self.suffix.finish(seq)
        if self.suffix is not None:
            self.stats.suffix_cache_tokens = self.suffix.num_tokens

    def _state(self, seq: Sequence) -> SpecState:
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = SpecState()
        return state

    def take(self, seqs: list[Sequence], num_drafts: list[int]) -> Drafts | None:
        """The drafts the step's sequences verify (the first num_drafts[i] of sequence i's
        pending ones: the budget may cut them), taken out of their states; None without any."""
        self._sample = None  # (a step that failed after `observe` is never timed)
        if not any(num_drafts):
            for seq in seqs:
                self._clear(self._states.get(seq.request_id))
            return None
        per_seq = []  # (ids on the host or the device, q where rejection sampling reads it)
        for seq, k in zip(seqs, num_drafts):
            state = self._states.get(seq.request_id) or SpecState()
            ids = (state.device[:k] if k and state.device is not None
                   else (state.drafts or [])[:k])
            read_q = k and state.q is not None and not by_pick(seq.params, self.coupled)
            per_seq.append((ids, state.q[:k] if read_q else None))
            self._clear(state)
        return Drafts.gather(per_seq, self.device)

    @property
    def num_states(self) -> int:
        """Requests with speculation state: those running (none once all finished)."""
        return len(self._states)

    def pending_drafts(self, seq: Sequence) -> list[int] | None:
        """The sequence's drafts waiting to be verified, where the host holds them."""
        state = self._states.get(seq.request_id)
        return None if state is None else state.drafts

    @staticmethod
    def _clear(state: SpecState | None) -> None:
        if state is not None:
            state.drafts = state.device = state.q = None

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      step: StepLogits) -> None:
        """The target pass's results (its captured hidden states: `step.hidden`, None when the
        runner captures none) and per item (sequence, first position, new tokens), for a
        proposer that drafts from them."""
        if step.hidden is not None and self.proposer is not None:
            self.proposer.keep_features(entries, step.hidden)

    # -- drafting --------------------------------------------------------------------------
    def propose(self, running: list[Sequence], num_joining: int,
                step_started: float | None = None) -> None:
        """Choose k and draft for every running sequence that is decoding.

        num_joining: waiting requests that will be admitted soon (they decode in this batch too);
        step_started: when the step that just committed its tokens began (perf_counter), so
        that its realized rate counts all of it.
        """
        started = time.perf_counter()
        if step_started is not None:
            self._since_catch_up += started - step_started
        if self._sample is not None and step_started is not None:
            seqs, speculative, emitted, excess = self._sample
            # the step's wall time and the proposal it verified, less the part of that
            # proposal's catch-up a steady run does not pay
            # (on CUDA the estimate may exceed what the wall clock saw of those forwards)
            seconds = started - step_started + self._propose_seconds
            self.realized.record(seqs, speculative, emitted, max(seconds - excess, 0.5 * seconds))
        self._sample, self._propose_seconds = None, 0.0
        try:
            self._propose(running, num_joining)
        finally:
            self._propose_seconds = time.perf_counter() - started

    def _propose(self, running: list[Sequence], num_joining: int) -> None:
        if self.suffix is not None:
            self.suffix.maintain()  # a bounded share of evicted texts' index cleanup
        candidates = [s for s in running if s.params.speculative
                      and s.num_computed_tokens == s.num_tokens - 1]
        drafting = self._draft(running, candidates, num_joining) if candidates else []
        if self.proposer is not None:  # what the proposer must follow of the others
            drafted = {id(s) for s in drafting}
            self.proposer.absorb([s for s in running if id(s) not in drafted])

    def _draft(self, running: list[Sequence], candidates: list[Sequence], num_joining: int
               ) -> list[Sequence]:
        """Choose and propose the drafts of `candidates`; returns those the proposer drafts
        for."""
        rooms = [self._room(s) for s in candidates]
        # (the class of the running batch: what the next step will most likely decode)
        mode = self.realized.decide(len(running)) if self.config.adaptive else "speculate"
        matches: list[SuffixDraft] | None = None  # suffix proposals: no draft forward needed
        if self.suffix is not None:
            for s in candidates:
                self.suffix.sync(s)
            if mode != "plain":
                matches = [self.suffix.propose(s, room) for s, room in zip(candidates, rooms)]
        draft_ks, suffix_ks = self._choose(running, candidates, rooms, num_joining, matches,
                                           mode)
        for s, k, match in zip(candidates, suffix_ks, matches or []):
            if k:
                self._set_drafts(s, match.token_ids[:k], None, ("suffix", match.match_length))
        chosen = [(s, k) for s, k in zip(candidates, draft_ks) if k > 0]
        if chosen:
            self._propose_with(*map(list, zip(*chosen)))
        return [s for s, _ in chosen]

    def _propose_with(self, seqs: list[Sequence], ks: list[int]) -> None:
        """The proposer's drafts for `seqs`, k each."""
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, ks)
        if proposal.device is None:  # read: its forwards have run
            self.stats.draft_seconds += time.perf_counter() - t0
            self._record_forwards(proposal)
        else:  # timed once the step that verifies it has read the device
            self._unread = proposal
        for j, (seq, q) in enumerate(zip(seqs, proposal.probs)):
            k = proposal.lengths[j]
            device = None if proposal.device is None else proposal.device[j, :k]
            self._set_drafts(seq, proposal.token_ids[j] if device is None else None, q,
                             (self.method, 0), device, k)

    def _record_forwards(self, proposal: Proposal) -> None:
        for num_tokens, num_seqs, seconds in proposal.forward_seconds():
            self.controller.draft_cost.record(num_tokens, num_seqs, seconds)

    def _set_drafts(self, seq: Sequence, drafts: list[int] | None, q: torch.Tensor | None,
                    method: tuple[str, int], device: torch.Tensor | None = None,
                    k: int | None = None) -> None:
        """drafts: on the host, or None where `device` ([k]) holds them (never for a
        sequence under a grammar: the proposer reads those)."""
        if seq.matcher is not None and drafts:  # structured output: drafts the grammar
            valid = seq.matcher.validate_tokens(list(drafts))  # allows, to the first not
            drafts, q = drafts[:valid], (None if q is None else q[:valid])
        k = len(drafts) if drafts is not None else k
        seq.num_draft_tokens = k
        state = self._state(seq)
        state.drafts = list(drafts) if drafts is not None else None
        state.device = device if k else None
        state.q = q if k else None
        state.method = method

    def _alpha(self, seq: Sequence, prior: float) -> float:
        """The sequence's acceptance estimate for the draft model (or prompt lookup)."""
        _, accepted, rejections = seq.spec_methods.get(self.method, (0, 0, 0))
        return AcceptanceStats(accepted, rejections).estimate(prior)

    def _choose(self, running: list[Sequence], candidates: list[Sequence], rooms: list[int],
                num_joining: int, matches: list[SuffixDraft] | None, mode: str
                ) -> tuple[list[int], list[int]]:
        """(proposer k, suffix k) per candidate, from the controller, cut to `rooms`: the
        drafts each sequence has room for; `mode`: RealizedRates.decide's for this step."""
        ctl = self.controller
        n = len(candidates)
        if mode == "plain":  # measured: plain steps are faster here (or being measured)
            self._catch_up = []
            ctl.decay_evidence()  # old evidence must not keep k at 0 for good
            self.stats.record_choice([0] * n)
            return [0] * n, [0] * n
        prior = ctl.prior_acceptance
        alphas = [self._alpha(s, prior) for s in candidates]
        others = [s for s in running if s not in candidates]
        other_tokens = sum(min(s.num_uncomputed_tokens, self.budget) for s in others)
        backlog = [self._backlog(s) for s in candidates]
        remaining = [self._expected_remaining(s, room) + 1 for s, room in zip(candidates, rooms)]
        pending = num_joining + sum(s.params.speculative and s.num_computed_tokens <
                                    s.num_tokens - 1 for s in running)  # decode soon
        measured = self.config.adaptive and not ctl.draft_cost_free \
            and self.realized.saving(len(running)) is not None
        # a long catch-up is judged by the plan's prediction (and capped: `_affordable`) until
        # speculation's saving here is measured, then by that (`_invest`); an exploring step
        # pays it where it is cheap enough
        affordable = not self.config.adaptive or (mode == "speculate" and measured) \
            or self._affordable(backlog)
        excused = (mode == "speculate" and measured) or (mode == "explore" and affordable)
        plan_backlog = [min(b, CATCH_UP_TOKENS) for b in backlog] if excused else backlog
        if self.suffix is None:
            draft_ks = ctl.choose(alphas, other_tokens, plan_backlog, remaining, pending,
                                  len(others))
            suffix_ks = [0] * n
        else:
            draft_ks, suffix_ks = ctl.choose_hybrid(
                alphas, [d.confidence for d in matches], other_tokens, plan_backlog, remaining,
                pending, len(others), draft=self.proposer is not None)
        if mode == "speculate" and measured:
            draft_ks = self._invest(draft_ks, backlog, remaining, len(running))
        elif not affordable:  # speculate only where the draft is caught up
            draft_ks = [0 if b > CATCH_UP_TOKENS else k for k, b in zip(draft_ks, backlog)]
        draft_ks = [min(k, room) for k, room in zip(draft_ks, rooms)]
        drafting = [b for k, b in zip(draft_ks, backlog) if k > 0]
        if any(b > CATCH_UP_TOKENS for b in drafting):
            self._since_catch_up = 0.0
        self._catch_up = drafting
        if not any(draft_ks):  # a step without drafts: old evidence must not keep k at 0 for good
            ctl.decay_evidence()
        self.stats.record_choice([max(a, b) for a, b in zip(draft_ks, suffix_ks)])
        for s, a in zip(candidates, alphas):
            self._state(s).acceptance = a
        return draft_ks, suffix_ks

    def _backlog(self, seq: Sequence) -> int:
        """Tokens the proposer must catch up on before it drafts for `seq`. A head runs its
        rows of the last verification's accepted tokens every step (up to k_max + 1, costed
        like a steady draft step); more is a catch-up (a prompt)."""
        b = self.proposer.backlog(seq) if self.proposer is not None else \
            seq.num_tokens - seq.num_draft_computed
        if self.method == "eagle" and b <= self.config.k_max + 1:
            return min(b, CATCH_UP_TOKENS)
        return b

    def _invest(self, draft_ks: list[int], backlog: list[int], remaining: list[int],
                num_running: int) -> list[int]:
        """Draft-model k per candidate, 0 where catching its draft up (a prompt, or tokens
        emitted while it did not draft) does not pay back over the tokens it is expected to
        emit still, at the saving speculation realized at this batch size. Without a realized
        saving the plan's prediction stands (KController's catch-up charge)."""
        out = list(draft_ks)
        for i, (k, b) in enumerate(zip(draft_ks, backlog)):
            if k and b > CATCH_UP_TOKENS and self.realized.pays_back(
                    num_running, remaining[i], self._catch_up_seconds([b])) is False:
                out[i] = 0
        return out

    def _catch_up_seconds(self, backlogs: list[int]) -> float:
        """What a draft-model forward catching these sequences up costs beyond a steady
        step's (CATCH_UP_TOKENS each at most), from the draft's cost table."""
        cost, n = self.controller.draft_cost, len(backlogs)
        if not n or self.proposer is None or self.controller.draft_cost_free:
            return 0.0
        steady = sum(min(max(b, 1), CATCH_UP_TOKENS) for b in backlogs)
        return max(cost(sum(max(b, 1) for b in backlogs), n) - cost(steady, n), 0.0)

    def _affordable(self, backlog: list[int]) -> bool:
        """Whether a step may catch the candidates' drafts up (all of them: the plan has not
        chosen yet) though no measured saving justifies it: for at most
        UNPROVEN_CATCH_UP_SHARE of the time since the last catch-up (a batch of new prompts at
        a batch size never measured, or where speculation lost, is not worth catching up at
        once). The first one ever is free."""
        return self._catch_up_seconds(backlog) <= UNPROVEN_CATCH_UP_SHARE * self._since_catch_up

    def _expected_remaining(self, seq: Sequence, room: int) -> int:
        """Tokens the sequence is expected to emit still: its room, or fewer where recent
        requests (not aborted) ended sooner: their mean output length less its own, and at
        least half that mean (a sequence past half the mean may be a long one)."""
        if self._mean_output is None:
            return room
        mean = self._mean_output
        return min(room, int(max(mean - seq.num_output_tokens, 0.5 * mean)))

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still matter: before max_tokens and inside the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    # -- verification ------------------------------------------------------------------------
    def observe(self, target_tokens: int, target_seqs: int, seconds: float | None,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        """One target pass (its cost includes verifying its drafts; `seconds` None when
        unknown: a CUDA step that read nothing back) and, per sequence, (seq, drafts verified,
        drafts accepted). Called after the step read the device, so the forwards of a
        proposal left there are timed now (the step's wall time includes their span on the
        device: the read waited for them)."""
        if self._unread is not None:
            proposal, self._unread = self._unread, None
            self._record_forwards(proposal)
            self.stats.draft_seconds += proposal.device_seconds()
        if seconds is not None:
            self.controller.target_cost.record(target_tokens, target_seqs, seconds)
        verified = list(verified)
        drafted = emitted = 0
        for seq, num_drafted, num_accepted in verified:
            drafted += num_drafted
            emitted += num_accepted + 1
            if num_drafted:
                self._record(seq, num_drafted, num_accepted)
            elif seq.request_id in self._states:
                self._states[seq.request_id].method = None
        catch_up, self._catch_up = self._catch_up, []
        if seconds is not None and len(verified) == target_seqs \
                and target_tokens == target_seqs + drafted:
            # a pure decode step: timed when the next proposal starts (see `propose`)
            self._sample = (target_seqs, drafted > 0, emitted,
                            self._catch_up_seconds(catch_up) if drafted else 0.0)

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        state = self._state(seq)
        method, match_length = state.method or (self.method, 0)
        state.method = None
        seq.num_drafted_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_rejections += num_accepted < num_drafted
        counts = seq.spec_methods.setdefault(method, [0, 0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted
        counts[2] += num_accepted < num_drafted
        self.stats.record_verification(num_drafted, num_accepted, method)
        if method == "suffix":  # the suffix cache calibrates its own confidences
            self.suffix.record(seq, match_length, num_drafted, num_accepted)
            return
        a = state.acceptance
        self.controller.record_verification(
            num_drafted, num_accepted,
            None if a is None else self.controller.predicted_accepted(a, num_drafted))


def build_speculator(config: EngineConfig, plan: RunnerPlan, target: ModelRunner,
                     block_manager: BlockManager, draft_model: torch.nn.Module | None,
                     tokenizer_size: int | None, max_model_len: int,
                     draft_vocabulary: torch.Tensor | None = None,
                     head: EagleHead | None = None) -> NoSpeculation:
    """The speculation the config asks for (calibrated when adaptive), or `NoSpeculation`.
    A draft model's runner follows `plan`, as the target's does; `draft_vocabulary`: the ids a
    draft model scores (None: all); `head`: the eagle method's head (the target's runner
    captures the layers it reads)."""
    speculative = config.speculative
    if not speculative.enabled:
        return NoSpeculation()
    proposer: Proposer | None = None
    if speculative.method == "ngram":
        proposer = NgramProposer(speculative.ngram_min_n, speculative.ngram_max_n)
    elif speculative.uses_head:
        proposer = EagleProposer(
            head, target.model, block_manager, target.shape.vocab_size, plan.attention_backend,
            seed=config.seed, coupled=speculative.verification == "coupled",
            stop_confidence=speculative.draft_stop_confidence)
    elif speculative.uses_draft_model:
        proposer = DraftModelProposer(
            draft_model, plan, block_manager, target.shape.vocab_size, max_model_len,
            tokenizer_size=tokenizer_size, seed=config.seed,
            stop_confidence=speculative.draft_stop_confidence,
            coupled=speculative.verification == "coupled", vocabulary=draft_vocabulary)
    suffix = None
    if speculative.method in ("suffix", "hybrid"):
        suffix = SuffixCache(max_tokens=speculative.suffix_cache_tokens,
                             cross_request=speculative.suffix_cross_request,
                             max_spec_tokens=speculative.suffix_max_spec_tokens,
                             spec_factor=speculative.suffix_spec_factor,
                             min_token_prob=speculative.suffix_min_token_prob)
    speculator = Speculator(speculative, proposer, max_model_len, config.max_num_batched_tokens,
                            target.device, suffix)
    if speculative.adaptive and speculative.calibrate:
        calibrate(speculator.controller, block_manager, target,
                  proposer if speculative.uses_head else getattr(proposer, "runner", None))
    return speculator
