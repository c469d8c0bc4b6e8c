"""Speculation inside the engine step: choose k, propose drafts, keep q and the statistics.

Must not schedule or verify: the engine calls `propose` after the scheduler committed a step's
tokens, and reads `draft_probs` when it verifies the drafts in the next step's target pass.
"""

from __future__ import annotations

import time

import torch

from engine.config import SpeculativeConfig
from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats, KController
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.stats import SpecDecodeStats

# one sequence of this many tokens; CALIBRATION_SEQS one-token sequences for the per-sequence cost
CALIBRATION_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
CALIBRATION_TOKENS_DRAFT = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALIBRATION_SEQS = 16


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.controller = KController(config.k_max, config.adaptive,
                                      draft_cost_free=config.method == "ngram")
        self.stats = SpecDecodeStats(k_max=config.k_max)
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q
        self._acceptance: dict[str, float] = {}  # request id -> estimate its drafts were chosen on

    # -- drafting --------------------------------------------------------------------------
    def propose(self, running: list[Sequence], budget: int, row_spec,
                num_waiting: int = 0) -> None:
        """Choose k and draft for every running sequence that is decoding.

        `row_spec(seq, drafts_so_far)` -> the sampler's RowSpec at the next position;
        num_waiting: admitted-soon requests still waiting (they will decode in this batch too).
        """
        candidates = [s for s in running if s.params.speculative
                      and s.num_computed_tokens == s.num_tokens - 1]
        if not candidates:
            return
        ctl = self.controller
        prior = ctl.prior_acceptance
        alphas = [AcceptanceStats(s.num_accepted_tokens, s.num_spec_rejections).estimate(prior)
                  for s in candidates]
        others = [s for s in running if s not in candidates]
        other_tokens = sum(min(s.num_uncomputed_tokens, budget) for s in others)
        backlog = [s.num_tokens - s.num_draft_computed for s in candidates]
        rooms = [self._room(s) for s in candidates]
        pending = num_waiting + sum(s.params.speculative and s.num_computed_tokens <
                                    s.num_tokens - 1 for s in running)  # decode soon
        ks = ctl.choose(alphas, other_tokens, backlog, [r + 1 for r in rooms], pending,
                        len(others))
        ks = [min(k, room) for k, room in zip(ks, rooms)]
        self.stats.record_choice(ks)
        chosen = [(s, k) for s, k in zip(candidates, ks) if k > 0]
        for s, a in zip(candidates, alphas):
            self._acceptance[s.request_id] = a
        if not chosen:
            return
        seqs = [s for s, _ in chosen]
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, [k for _, k in chosen],
                                         lambda i, drafts: row_spec(seqs[i], drafts))
        self.stats.draft_seconds += time.perf_counter() - t0
        for num_tokens, num_seqs, seconds in getattr(self.proposer, "last_step_seconds", ()):
            ctl.record_draft(num_tokens, num_seqs, seconds)
        for seq, drafts, q in zip(seqs, proposal.token_ids, proposal.probs):
            seq.draft_token_ids = list(drafts)
            if q is not None and drafts:
                self._draft_probs[seq.request_id] = q
            else:
                self._draft_probs.pop(seq.request_id, None)

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still matter: before max_tokens and inside the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    # -- verification bookkeeping ------------------------------------------------------------
    def draft_probs(self, seq: Sequence, k: int) -> torch.Tensor | None:
        q = self._draft_probs.pop(seq.request_id, None)
        return None if q is None else q[:k]

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        seq.num_drafted_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_rejections += num_accepted < num_drafted
        self.stats.record_verification(num_drafted, num_accepted)
        a = self._acceptance.get(seq.request_id)
        self.controller.record_verification(
            num_drafted, num_accepted,
            None if a is None else self.controller.predicted_accepted(a, num_drafted))

    def record_target_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        self.controller.record_target(num_tokens, num_seqs, seconds)

    def forget(self, seq: Sequence, finished: bool) -> None:
        self._draft_probs.pop(seq.request_id, None)
        self._acceptance.pop(seq.request_id, None)
        if finished:
            self.proposer.free(seq)
