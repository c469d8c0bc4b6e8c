"""Speculation inside the engine step: choose k, propose drafts, keep q and the statistics.

Must not schedule or verify. The engine calls the same four hooks every step whether
speculation is on or not (`NoSpeculation` does nothing in each, so speculation off is a true
plain step): `drop` sequences that left the running set, `draft_probs` while it verifies,
`observe` the target pass and its verifications, `propose` after the scheduler committed the
step's tokens.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SpeculativeConfig
from engine.model_runner import ModelRunner
from engine.sample.sampler import RowSpec
from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats, KController
from engine.spec_decode.calibration import calibrate
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.stats import SpecDecodeStats

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

    def observe(self, target_tokens: int, target_seqs: int, seconds: float,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        pass

    def propose(self, running: list[Sequence], num_joining: int, row_spec: RowSpecFn) -> None:
        pass


class Speculator(NoSpeculation):
    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.controller = KController(config.k_max, config.adaptive,
                                      draft_cost_free=config.method == "ngram")
        self.stats = SpecDecodeStats(k_max=config.k_max)
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q
        self._acceptance: dict[str, float] = {}  # request id -> estimate its drafts were chosen on

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        """Forget the drafts of sequences that left the running set (and all of their state
        once `finished`)."""
        for seq in seqs:
            self._draft_probs.pop(seq.request_id, None)
            self._acceptance.pop(seq.request_id, None)
            if finished:
                self.proposer.free(seq)

    # -- drafting --------------------------------------------------------------------------
    def propose(self, running: list[Sequence], num_joining: int, row_spec: RowSpecFn) -> None:
        """Choose k and draft for every running sequence that is decoding.

        num_joining: waiting requests that will be admitted soon (they decode in this batch too).
        """
        candidates = [s for s in running if s.params.speculative
                      and s.num_computed_tokens == s.num_tokens - 1]
        if not candidates:
            return
        ks = self._choose(running, candidates, num_joining)
        chosen = [(s, k) for s, k in zip(candidates, ks) if k > 0]
        if not chosen:
            return
        seqs = [s for s, _ in chosen]
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, [k for _, k in chosen],
                                         lambda i, drafts: row_spec(seqs[i], drafts))
        self.stats.draft_seconds += time.perf_counter() - t0
        for num_tokens, num_seqs, seconds in proposal.forward_seconds:
            self.controller.draft_cost.record(num_tokens, num_seqs, seconds)
        for seq, drafts, q in zip(seqs, proposal.token_ids, proposal.probs):
            if seq.matcher is not None and drafts:  # structured output: drafts the grammar
                valid = seq.matcher.validate_tokens(list(drafts))  # allows, to the first not
                drafts, q = drafts[:valid], (None if q is None else q[:valid])
            seq.draft_token_ids = list(drafts)
            if q is not None and drafts:
                self._draft_probs[seq.request_id] = q
            else:
                self._draft_probs.pop(seq.request_id, None)

    def _choose(self, running: list[Sequence], candidates: list[Sequence],
                num_joining: int) -> list[int]:
        """k per candidate, from the controller, cut to the room each sequence has left."""
        ctl = self.controller
        prior = ctl.prior_acceptance
        alphas = [AcceptanceStats(s.num_accepted_tokens, s.num_spec_rejections).estimate(prior)
                  for s in candidates]
        others = [s for s in running if s not in candidates]
        other_tokens = sum(min(s.num_uncomputed_tokens, self.budget) for s in others)
        backlog = [s.num_tokens - s.num_draft_computed for s in candidates]
        rooms = [self._room(s) for s in candidates]
        pending = num_joining + sum(s.params.speculative and s.num_computed_tokens <
                                    s.num_tokens - 1 for s in running)  # decode soon
        ks = ctl.choose(alphas, other_tokens, backlog, [r + 1 for r in rooms], pending,
                        len(others))
        if not any(ks):  # a step without drafts: old evidence must not keep k at 0 for good
            ctl.decay_evidence()
        ks = [min(k, room) for k, room in zip(ks, rooms)]
        self.stats.record_choice(ks)
        for s, a in zip(candidates, alphas):
            self._acceptance[s.request_id] = a
        return ks

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

    def observe(self, target_tokens: int, target_seqs: int, seconds: float,
                verified: Iterable[tuple[Sequence, int, int]]) -> None:
        """One target pass (its cost includes verifying its drafts) and, per sequence,
        (seq, drafts verified, drafts accepted)."""
        self.controller.target_cost.record(target_tokens, target_seqs, seconds)
        for seq, num_drafted, num_accepted in verified:
            if num_drafted:
                self._record(seq, num_drafted, num_accepted)

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        seq.num_drafted_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_rejections += num_accepted < num_drafted
        self.stats.record_verification(num_drafted, num_accepted)
        a = self._acceptance.get(seq.request_id)
        self.controller.record_verification(
            num_drafted, num_accepted,
            None if a is None else self.controller.predicted_accepted(a, num_drafted))


def build_speculator(config: EngineConfig, target: ModelRunner, block_manager: BlockManager,
                     draft_model: torch.nn.Module | None, tokenizer_size: int | None,
                     max_model_len: int) -> NoSpeculation:
    """The speculation the config asks for (calibrated when adaptive), or `NoSpeculation`."""
    speculative = config.speculative
    if not speculative.enabled:
        return NoSpeculation()
    if speculative.method == "ngram":
        proposer: Proposer = NgramProposer(speculative.ngram_min_n, speculative.ngram_max_n)
    else:
        proposer = DraftModelProposer(
            draft_model, num_blocks=block_manager.num_blocks, block_size=config.block_size,
            block_manager=block_manager, target_vocab_size=target.shape.vocab_size,
            tokenizer_size=tokenizer_size, seed=config.seed,
            cpu_matmul_autotune=config.cpu_matmul_autotune,
            stop_confidence=speculative.draft_stop_confidence)
    speculator = Speculator(speculative, proposer, max_model_len, config.max_num_batched_tokens)
    if speculative.adaptive and speculative.calibrate:
        calibrate(speculator.controller, block_manager, target,
                  getattr(proposer, "runner", None))
    return speculator
