"""Speculation inside the engine step: choose k, propose drafts, keep q and the statistics.

Must not schedule or verify. The engine calls the same four hooks every step whether
speculation is on or not (`NoSpeculation` does nothing in each, so speculation off is a true
plain step): `drop` sequences that left the running set, `draft_probs` while it verifies,
`observe` the target pass and its verifications, `propose` after the scheduler committed the
step's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SpeculativeConfig
from engine.model_runner import ModelRunner
from engine.sample.sampler import RowSpec
from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats, KController, RealizedRates
from engine.spec_decode.calibration import calibrate
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposal, Proposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.suffix import SuffixCache, SuffixDraft

# a step whose drafts come after more tokens than a steady run leaves the draft model behind
# (the bonus token, and the last draft when all were accepted) includes a catch-up
CATCH_UP_TOKENS = 2

# row_spec(seq, drafts_so_far) -> how to sample the position after those drafts
RowSpecFn = Callable[[Sequence, list[int]], RowSpec]


class NoSpeculation:
    """Speculation off (or a request opted out everywhere): every hook is a no-op."""

    enabled = False
    stats: SpecDecodeStats | None = None

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        pass

    def draft_probs(self, seq: Sequence, k: int) -> torch.Tensor | None:
        return None

    def pop_device_drafts(self, seq: Sequence) -> torch.Tensor | None:
        return None

    def observe(self, target_tokens: int, target_seqs: int, seconds: float | None,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        pass

    def propose(self, running: list[Sequence], num_joining: int, row_spec: RowSpecFn) -> None:
        pass


class Speculator(NoSpeculation):
    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None,
                 max_model_len: int, max_num_batched_tokens: int,
                 suffix: SuffixCache | None = None) -> None:
        self.config = config
        self.proposer = proposer  # the draft model or prompt lookup; None: suffix only
        self.suffix = suffix  # suffix and hybrid
        self.method = "ngram" if config.method == "ngram" else "draft_model"  # the proposer's
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.controller = KController(config.k_max, config.adaptive,
                                      draft_cost_free=config.method == "ngram")
        k_stats = max(config.k_max, config.suffix_max_spec_tokens if suffix else 0)
        self.stats = SpecDecodeStats(k_max=k_stats)
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q
        # request id -> [k] its drafts on the device, when the host has not read them (its
        # draft_token_ids hold placeholders)
        self._device_drafts: dict[str, torch.Tensor] = {}
        self._unread: Proposal | None = None  # the last proposal, its forwards not timed yet
        self._acceptance: dict[str, float] = {}  # request id -> estimate its drafts were chosen on
        # request id -> (method, match length of a suffix proposal) of its pending drafts
        self._method: dict[str, tuple[str, int]] = {}
        self.realized = RealizedRates()
        self._propose_seconds = 0.0  # the last propose call (paid by the step that verifies)
        self._catching_up = False  # the last proposal included a draft-model catch-up

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        """Forget the drafts of sequences that left the running set (and all of their state
        once `finished`; a finished sequence's text joins the suffix cache)."""
        for seq in seqs:
            self._draft_probs.pop(seq.request_id, None)
            self._device_drafts.pop(seq.request_id, None)
            self._acceptance.pop(seq.request_id, None)
            self._method.pop(seq.request_id, None)
            if finished:
                if self.proposer is not None:
                    self.proposer.free(seq)
                if self.suffix is not None:
                    self.suffix.finish(seq)
        if self.suffix is not None:
            self.stats.suffix_cache_tokens = self.suffix.num_tokens

    # -- drafting --------------------------------------------------------------------------
    def propose(self, running: list[Sequence], num_joining: int, row_spec: RowSpecFn) -> None:
        """Choose k and draft for every running sequence that is decoding.

        num_joining: waiting requests that will be admitted soon (they decode in this batch too).
        """
        started = time.perf_counter()
        try:
            self._propose(running, num_joining, row_spec)
        finally:
            self._propose_seconds = time.perf_counter() - started

    def _propose(self, running: list[Sequence], num_joining: int, row_spec: RowSpecFn) -> None:
        if self.suffix is not None:
            self.suffix.maintain()  # a bounded share of evicted texts' index cleanup
        candidates = [s for s in running if s.params.speculative
                      and s.num_computed_tokens == s.num_tokens - 1]
        if not candidates:
            return
        rooms = [self._room(s) for s in candidates]
        free: list[SuffixDraft] | None = None
        if self.suffix is not None:
            for s in candidates:
                self.suffix.sync(s)
            free = [self.suffix.propose(s, room) for s, room in zip(candidates, rooms)]
        ks, kf = self._choose(running, candidates, rooms, num_joining, free)
        for s, k, draft in zip(candidates, kf, free or []):
            if k:
                self._set_drafts(s, draft.token_ids[:k], None, ("suffix", draft.match_length))
        chosen = [(s, k) for s, k in zip(candidates, ks) if k > 0]
        if not chosen:
            return
        seqs = [s for s, _ in chosen]
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, [k for _, k in chosen],
                                         lambda i, drafts: row_spec(seqs[i], drafts))
        if proposal.device is None:  # read: its forwards have run
            self.stats.draft_seconds += time.perf_counter() - t0
            self._record_forwards(proposal)
        else:  # timed once the step that verifies it has read the device
            self._unread = proposal
        for j, (seq, drafts, q) in enumerate(zip(seqs, proposal.token_ids, proposal.probs)):
            device = None if proposal.device is None else proposal.device[j, :len(drafts)]
            self._set_drafts(seq, drafts, q, (self.method, 0), device)

    def _record_forwards(self, proposal: Proposal) -> None:
        for num_tokens, num_seqs, seconds in proposal.forward_seconds():
            self.controller.draft_cost.record(num_tokens, num_seqs, seconds)

    def _set_drafts(self, seq: Sequence, drafts: list[int], q: torch.Tensor | None,
                    method: tuple[str, int], device: torch.Tensor | None = None) -> None:
        """device: the drafts on the device when the host holds only placeholders (never for
        a sequence under a grammar: the proposer reads those)."""
        if seq.matcher is not None and drafts:  # structured output: drafts the grammar
            valid = seq.matcher.validate_tokens(list(drafts))  # allows, to the first not
            drafts, q = drafts[:valid], (None if q is None else q[:valid])
        seq.draft_token_ids = list(drafts)
        if q is not None and drafts:
            self._draft_probs[seq.request_id] = q
        else:
            self._draft_probs.pop(seq.request_id, None)
        if device is not None and drafts:
            self._device_drafts[seq.request_id] = device
        else:
            self._device_drafts.pop(seq.request_id, None)
        self._method[seq.request_id] = method

    def _alpha(self, seq: Sequence, prior: float) -> float:
        """The sequence's acceptance estimate for the draft model (or prompt lookup)."""
        _, accepted, rejections = seq.spec_methods.get(self.method, (0, 0, 0))
        return AcceptanceStats(accepted, rejections).estimate(prior)

    def _choose(self, running: list[Sequence], candidates: list[Sequence], rooms: list[int],
                num_joining: int, free: list[SuffixDraft] | None) -> tuple[list[int], list[int]]:
        """(proposer k, suffix k) per candidate, from the controller, cut to `rooms`: the
        drafts each sequence has room for."""
        ctl = self.controller
        prior = ctl.prior_acceptance
        alphas = [self._alpha(s, prior) for s in candidates]
        others = [s for s in running if s not in candidates]
        other_tokens = sum(min(s.num_uncomputed_tokens, self.budget) for s in others)
        backlog = [s.num_tokens - s.num_draft_computed for s in candidates]
        pending = num_joining + sum(s.params.speculative and s.num_computed_tokens <
                                    s.num_tokens - 1 for s in running)  # decode soon
        if free is None:
            ks = ctl.choose(alphas, other_tokens, backlog, [r + 1 for r in rooms], pending,
                            len(others))
            kf = [0] * len(candidates)
        else:
            ks, kf = ctl.choose_hybrid(alphas, [d.confidence for d in free], other_tokens,
                                       backlog, [r + 1 for r in rooms], pending, len(others),
                                       draft=self.proposer is not None)
        if (any(ks) or any(kf)) and self.config.adaptive \
                and not self.realized.speculate(len(running)):
            ks, kf = [0] * len(ks), [0] * len(kf)  # measured: plain steps are faster here
        # the draft model catching up on tokens it missed (after plain steps): the step's
        # realized rate is not what steady speculation reaches
        self._catching_up = any(k > 0 and b > CATCH_UP_TOKENS for k, b in zip(ks, backlog))
        if not any(ks):  # a step without drafts: old evidence must not keep k at 0 for good
            ctl.decay_evidence()
        ks = [min(k, room) for k, room in zip(ks, rooms)]
        self.stats.record_choice([max(a, b) for a, b in zip(ks, kf)])
        for s, a in zip(candidates, alphas):
            self._acceptance[s.request_id] = a
        return ks, kf

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still matter: before max_tokens and inside the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    # -- verification ------------------------------------------------------------------------
    def draft_probs(self, seq: Sequence, k: int) -> torch.Tensor | None:
        """q of the first k drafts being verified ([k, V]); None for deterministic drafts."""
        q = self._draft_probs.pop(seq.request_id, None)
        return None if q is None else q[:k]

    def pop_device_drafts(self, seq: Sequence) -> torch.Tensor | None:
        """The sequence's drafts on the device ([len(seq.draft_token_ids)]) when the host
        holds placeholders for them, else None; taken by the step that runs them."""
        return self._device_drafts.pop(seq.request_id, None)

    def observe(self, target_tokens: int, target_seqs: int, seconds: float | None,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        """One target pass (its cost includes verifying its drafts; `seconds` None when
        unknown: a CUDA step that read nothing back) and, per sequence, (seq, drafts verified,
        drafts accepted). Called after the step read the device, so the forwards of a
        proposal left there are timed now; their span on the device is what the step paid for
        drafting (the host only queued them)."""
        if self._unread is not None:
            proposal, self._unread = self._unread, None
            self._record_forwards(proposal)
            drafting = proposal.device_seconds()
            self.stats.draft_seconds += drafting
            self._propose_seconds = max(self._propose_seconds, drafting)
        if seconds is not None:
            self.controller.target_cost.record(target_tokens, target_seqs, seconds)
        verified = list(verified)
        drafted = emitted = 0
        for seq, num_drafted, num_accepted in verified:
            drafted += num_drafted
            emitted += num_accepted + 1
            if num_drafted:
                self._record(seq, num_drafted, num_accepted)
            else:
                self._method.pop(seq.request_id, None)
        if seconds is not None and len(verified) == target_seqs \
                and target_tokens == target_seqs + drafted and not (drafted and self._catching_up):
            # a pure decode step: what it realized, drafting included
            self.realized.record(target_seqs, drafted > 0, emitted,
                                 seconds + self._propose_seconds)
        self._propose_seconds = 0.0

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        method, match_length = self._method.pop(seq.request_id, (self.method, 0))
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
        a = self._acceptance.get(seq.request_id)
        self.controller.record_verification(
            num_drafted, num_accepted,
            None if a is None else self.controller.predicted_accepted(a, num_drafted))


def build_speculator(config: EngineConfig, target: ModelRunner, block_manager: BlockManager,
                     draft_model: torch.nn.Module | None, tokenizer_size: int | None,
                     max_model_len: int,
                     prepare_runner: Callable[[ModelRunner], None] | None = None,
                     draft_vocabulary: torch.Tensor | None = None) -> NoSpeculation:
    """The speculation the config asks for (calibrated when adaptive), or `NoSpeculation`.
    `prepare_runner` is applied to the draft model's runner before calibration;
    `draft_vocabulary`: the ids a draft model scores (None: all)."""
    speculative = config.speculative
    if not speculative.enabled:
        return NoSpeculation()
    proposer: Proposer | None = None
    if speculative.method == "ngram":
        proposer = NgramProposer(speculative.ngram_min_n, speculative.ngram_max_n)
    elif speculative.uses_draft_model:
        proposer = DraftModelProposer(
            draft_model, num_blocks=block_manager.num_blocks, block_size=config.block_size,
            block_manager=block_manager, target_vocab_size=target.shape.vocab_size,
            tokenizer_size=tokenizer_size, seed=config.seed,
            cpu_matmul_autotune=config.cpu_matmul_autotune,
            stop_confidence=speculative.draft_stop_confidence,
            attention_backend=config.attention_backend,
            attention_kv_split=config.attention_kv_split,
            coupled=speculative.verification == "coupled", vocabulary=draft_vocabulary)
        if prepare_runner is not None:
            prepare_runner(proposer.runner)
    suffix = None
    if speculative.method in ("suffix", "hybrid"):
        suffix = SuffixCache(max_tokens=speculative.suffix_cache_tokens,
                             cross_request=speculative.suffix_cross_request,
                             max_spec_tokens=speculative.suffix_max_spec_tokens,
                             spec_factor=speculative.suffix_spec_factor,
                             min_token_prob=speculative.suffix_min_token_prob)
    speculator = Speculator(speculative, proposer, max_model_len, config.max_num_batched_tokens,
                            suffix)
    if speculative.adaptive and speculative.calibrate:
        calibrate(speculator.controller, block_manager, target,
                  getattr(proposer, "runner", None))
    return speculator
