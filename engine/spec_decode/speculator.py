"""Speculation inside the engine step: propose drafts, keep each request's state, dispatch to
the proposers; the guard (guard.py) decides how many.

Must not schedule or verify. The engine makes the same three calls every step whether
speculation is on or not (`NoSpeculation` does nothing in each, so speculation off is a true
plain step):
1. `take(out)`: the step's schedule: forget the preempted sequences, and the drafts the
   scheduled ones verify (one `Drafts` for the step);
2. `verified(out, step, emitted)`: the target pass's results: a head's features, each
   sequence's accepted drafts;
3. `propose(running, finished, num_joining, record)`: after the scheduler committed the step's
   tokens: forget the finished sequences, hand the guard the step's `StepRecord` (what ran and
   when), and draft for every decoding sequence as the guard chooses.
(`drop` also forgets an aborted request, outside the step.)

A request's speculation state between steps is one `SpecState` here: its pending drafts (on the
host, or on the device only), their q, the method that proposed them and the acceptance
estimate they were chosen on. The `Sequence` only counts its pending drafts
(`num_draft_tokens`, for the scheduler's budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from engine.batch import MAX_TREE_NODES, ROOT, Drafts, StepLogits, is_chain, tree_paths
from engine.block_manager import BlockManager
from engine.device_io import to_device
from engine.config import EngineConfig, SpeculativeConfig
from engine.model_runner import ModelRunner
from engine.runner_plan import RunnerPlan
from engine.sample.row_spec import by_pick
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode import tree_draft
from engine.spec_decode.calibration import calibrate
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleHead
from engine.spec_decode.eagle_proposer import EagleProposer
from engine.spec_decode.guard import Choice, Guard, StepRecord
from engine.spec_decode.lookahead import LookaheadPool
from engine.spec_decode.medusa import MedusaHeads
from engine.spec_decode.medusa_proposer import MedusaProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.prediction import PredictionMatcher
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.suffix import SuffixCache, SuffixDraft


@dataclass
class SpecState:
    """One request's speculation between steps."""

    drafts: list[int] | None = None  # pending drafts on the host (None: none, or `device`)
    device: torch.Tensor | None = None  # [k] pending drafts that only the device holds
    q: torch.Tensor | None = None  # [k, V] their draft probabilities (None: one-hot)
    parents: list[int] | None = None  # the pending drafts' token tree (None: a chain)
    confidence: list[float] | None = None  # a proposer's tree: each node's chance (its path's
    #                                        probability under the proposer)
    predicted: float | None = None  # the verified tree's: the accepted tokens they predicted
    method: tuple[str, int] | None = None  # (method, suffix match length) of the pending drafts
    acceptance: float | None = None  # the estimate its last drafts were chosen on
    prediction: PredictionMatcher | None = None  # its Predicted Outputs, where it has one
    lookahead: int = 0  # its pending drafts' last ones that are lookahead rows (not verified)


class NoSpeculation:
    """Speculation off (or a request opted out everywhere): every call is a no-op."""

    enabled = False
    stats: SpecDecodeStats | None = None

    def take(self, out: SchedulerOutput) -> Drafts | None:
        return None

    def verified(self, out: SchedulerOutput, step: StepLogits, emitted: list[list[int]],
                 drafts: Drafts | None = None, paths: list[list[int] | None] | None = None,
                 window: list[list[int] | None] | None = None) -> None:
        """The target pass's results: its logits rows and, when the runner captured them, a
        draft head's features (`step.hidden`: `keep_features` gets them); per scheduled
        sequence the tokens it emitted ([] for none)."""
        if step.hidden is None:
            return
        if paths is None or not any(p is not None for p in paths):
            self.keep_features([(s.seq, s.start, len(s.token_ids) + s.num_drafts)
                                for s in out.scheduled], step)
            return
        # a token tree's features: its committed tokens', then its accepted path's, in order
        rows, entries, at = [], [], 0
        for s, path in zip(out.scheduled, paths):
            n = len(s.token_ids)
            keep = range(at, at + n + s.num_drafts) if path is None else \
                [*range(at, at + n), *(at + n + node for node in path)]
            rows += keep
            entries.append((s.seq, s.start, len(keep)))
            at += n + s.num_drafts
        index = to_device(rows, torch.long, step.hidden.device)
        self.keep_features(entries, replace(step, hidden=step.hidden[index]))

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      step: StepLogits) -> None:
        """Per item of the target pass (sequence, first position, new tokens), with its
        captured features (`step.hidden`)."""

    def propose(self, running: list[Sequence], finished: list[Sequence], num_joining: int,
                record: StepRecord) -> None:
        pass

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        pass


class Speculator(NoSpeculation):
    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None,
                 max_model_len: int, max_num_batched_tokens: int, device: torch.device,
                 suffix: SuffixCache | None = None,
                 lookahead: LookaheadPool | None = None) -> None:
        """device: the target's (where each step's drafts go); suffix, lookahead: draftless
        sources (suffix matches; lookahead decoding's n-gram pool and window)."""
        self.config = config
        self.tree_nodes = config.tree_max_nodes  # proposals may be token trees
        self.device = device
        self.coupled = config.verification == "coupled"
        self.proposer = proposer  # the draft model, a head or prompt lookup; None: suffix only
        self.suffix = suffix  # suffix and hybrid
        self.lookahead = lookahead  # lookahead, and hybrid with `lookahead` set
        self.method = (proposer.method if proposer is not None
                       else "lookahead" if suffix is None and lookahead is not None
                       else "draft_model")
        self.max_model_len = max_model_len
        k_stats = max(config.k_max, config.suffix_max_spec_tokens if suffix else 0,
                      MAX_TREE_NODES if lookahead else 0)
        self.stats = SpecDecodeStats(k_max=k_stats)
        self.guard = Guard(config, self.stats, self.method, proposer is not None,
                           suffix is not None, max_num_batched_tokens)
        self._states: dict[str, SpecState] = {}  # request id -> its speculation

    # -- the step -----------------------------------------------------------------------------
    def take(self, out: SchedulerOutput) -> Drafts | None:
        """Forget the preempted sequences (recomputed from their committed tokens); the drafts
        the scheduled sequences verify (the first num_drafts of each one's pending drafts: the
        budget may cut them), taken out of their states; None without any."""
        self.drop(out.preempted, finished=False)
        if out.is_empty:
            return None
        if not any(s.num_drafts for s in out.scheduled):
            for s in out.scheduled:
                self._clear(self._states.get(s.seq.request_id))
            return None
        per_seq = []  # (ids on the host or the device, q where rejection sampling reads it)
        trees = []  # their parents where they are token trees (the first k nodes: a tree)
        lookahead = []  # their lookahead rows (the budget cuts those first)
        tree_q = []  # sampled trees' q (rejection sampling reads it)
        for s in out.scheduled:
            seq, k = s.seq, s.num_drafts
            state = self._states.get(seq.request_id) or SpecState()
            ids = (state.device[:k] if k and state.device is not None
                   else (state.drafts or [])[:k])
            read_q = k and state.q is not None and not by_pick(seq.params, self.coupled)
            tree = state.parents[:k] if k and state.parents is not None else None
            # (a sampled tree's q: the root's row, then each node's; its first k rows are a
            # chain's, each draft's, where the budget cut it to one)
            chain = tree is None or is_chain(tree)
            per_seq.append((ids, state.q[:k] if read_q and chain else None))
            tree_q.append(state.q[:k + 1] if read_q and not chain else None)
            trees.append(tree)
            # (the budget cuts the window's rows first: those past the verified drafts)
            lookahead.append(0 if state.drafts is None
                             else max(k - (len(state.drafts) - state.lookahead), 0))
            state.predicted = (sum(state.confidence[:k]) if k and state.confidence is not None
                               else None)
            self._clear(state)
        return Drafts.gather(per_seq, self.device, trees, lookahead, tree_q)

    def verified(self, out: SchedulerOutput, step: StepLogits, emitted: list[list[int]],
                 drafts: Drafts | None = None, paths: list[list[int] | None] | None = None,
                 window: list[list[int] | None] | None = None) -> None:
        """drafts, paths: the step's drafts and, where they were token trees, each one's
        accepted path (`Verified.paths`); window: per sequence the target's argmax at its
        lookahead rows (`Verified.window`: read with the tokens), the windows' next level."""
        super().verified(out, step, emitted, drafts, paths)
        for i, (s, tokens) in enumerate(zip(out.scheduled, emitted)):
            k = drafts.num_verified(i) if s.num_drafts else 0  # (lookahead rows are not)
            if tokens and k:
                tree = drafts.parents_of(i)
                tree = None if tree is None or is_chain(tree[:k]) else tree[:k]
                path = paths[i] if paths is not None else None
                # a rejection: the accepted path ends where the proposal went on (a chain:
                # before its last draft; a tree: at a node with children, or the root)
                rejected = (len(tokens) - 1 < k if tree is None
                            else (path[-1] if path else -1) in tree)
                self._record(s.seq, k, len(tokens) - 1, rejected, tree, path)
            elif tokens and s.seq.request_id in self._states:
                self._states[s.seq.request_id].method = None
        if self.lookahead is not None and window is not None:
            for s, picks in zip(out.scheduled, window):
                if picks:
                    self.lookahead.stepped(s.seq, len(picks), picks)

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      step: StepLogits) -> None:
        if self.proposer is not None:  # a proposer that drafts from them (a head)
            self.proposer.keep_features(entries, step.hidden)

    def propose(self, running: list[Sequence], finished: list[Sequence], num_joining: int,
                record: StepRecord) -> None:
        """Forget the `finished` sequences; the step's record to the guard; then choose k and
        draft for every running sequence that is decoding. num_joining: waiting requests that
        will be admitted soon (they decode in this batch too)."""
        self.drop(finished, finished=True)
        started = time.perf_counter()
        self.guard.step(record, started)
        try:
            self._propose(running, num_joining)
        finally:
            self.guard.proposed(time.perf_counter() - started)

    def drop(self, seqs: list[Sequence], finished: bool) -> None:
        """Forget the speculation of sequences that left the running set (a preempted one is
        recomputed from its committed tokens; a finished one's text joins the suffix cache)."""
        for seq in seqs:
            self._states.pop(seq.request_id, None)
            if finished and seq.finish_reason != "abort":
                self.guard.finished(seq.num_output_tokens)
            if self.proposer is not None:  # (a preempted one is recomputed)
                self.proposer.forget(seq)
            if self.lookahead is not None:
                self.lookahead.forget(seq)
            if finished and self.suffix is not None:
                self.suffix.finish(seq)
        if self.suffix is not None:
            self.stats.suffix_cache_tokens = self.suffix.num_tokens

    # -- state --------------------------------------------------------------------------------
    def _state(self, seq: Sequence) -> SpecState:
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = SpecState()
        return state

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
            state.drafts = state.device = state.q = state.parents = state.confidence = None
            state.lookahead = 0

    # -- drafting -----------------------------------------------------------------------------
    def _propose(self, running: list[Sequence], num_joining: int) -> None:
        if self.suffix is not None:
            self.suffix.maintain()  # a bounded share of evicted texts' index cleanup
        candidates = [s for s in running if s.params.speculative
                      and s.num_computed_tokens == s.num_tokens - 1]
        if candidates:
            self._draft(running, candidates, num_joining)

    def _draft(self, running: list[Sequence], candidates: list[Sequence], num_joining: int
               ) -> None:
        """Propose the drafts of `candidates` the guard chooses."""
        rooms = [self._room(s) for s in candidates]
        # (the class of the running batch: what the next step will most likely decode)
        mode = self.guard.mode(len(running))
        matches = None  # free proposals (suffix matches, predictions): no draft forward
        if self.suffix is not None:
            for s in candidates:
                self.suffix.sync(s)
        # token trees (the proposer's, the suffix tree's) or chains this step: the guard's
        # choice from their realized rates where a tree is possible
        tree_ok = [self.tree_nodes > 0 and self._proposer_tree_ok(s) for s in candidates]
        shaped = mode != "plain" and self.tree_nodes > 0 and (
            self.suffix is not None or any(tree_ok))
        trees = shaped and self.guard.trees(len(running))
        if mode != "plain" and (self.suffix is not None or self.lookahead is not None
                                or any(s.params.prediction for s in candidates)):
            matches = [self._free(s, room, trees) for s, room in zip(candidates, rooms)]
        choice = self.guard.choose(running, candidates, rooms, num_joining,
                                   None if matches is None else [m.confidence
                                                                 for m, _ in matches],
                                   mode, self._backlog)
        for s, a in zip(candidates, choice.acceptance):
            self._state(s).acceptance = a
        for s, k, (match, method) in zip(candidates, choice.suffix_ks, matches or []):
            if k:
                self._set_drafts(s, match.token_ids[:k], None, (method, match.match_length),
                                 parents=match.parents[:k] if match.parents else None)
        if shaped and not any(k and ok for k, ok in zip(choice.draft_ks, tree_ok)) and not any(
                k and method == "suffix" for k, (_, method) in zip(choice.suffix_ks,
                                                                   matches or [])):
            self.guard.no_shape()  # (nothing drafted by a source the shape applies to)
        tree_seqs, chains = [], []
        for s, k, room, ok in zip(candidates, choice.draft_ks, rooms, tree_ok):
            if k > 0:
                (tree_seqs if trees and ok else chains).append((s, k, room))
        if chains:
            self._propose_with([s for s, _, _ in chains], [k for _, k, _ in chains])
        if tree_seqs:
            self._propose_trees([s for s, _, _ in tree_seqs], [r for _, _, r in tree_seqs],
                                [k for _, k, _ in tree_seqs],
                                *self.guard.tree_prices(choice))
        if self.lookahead is not None and mode != "plain":  # (priced at the pass's size with
            # every other draft of the step in it)
            self._pool_probe(running, candidates, choice, matches)
            self._windows(running, [s for s, k in zip(candidates, choice.draft_ks) if not k])

    def _pool_probe(self, running: list[Sequence], candidates: list[Sequence], choice: Choice,
                    matches: list[tuple[SuffixDraft, str]]) -> None:
        """At most one sequence a step verifies the lookahead pool's proposal that the plan
        priced out (`LookaheadPool.probe`: its chances are learned from verified proposals
        only), up to ngram - 1 nodes, at the guard's price of a row in this pass."""
        price = None
        for s, dk, sk, (match, method) in zip(candidates, choice.draft_ks, choice.suffix_ks,
                                              matches or []):
            if dk or sk or method != "lookahead" or not match.token_ids:
                continue
            nodes = min(len(match.token_ids), self.lookahead.n - 1)
            if price is None:
                price = self._row_price(running, nodes)
            if self.lookahead.probe(nodes, price):
                self._set_drafts(s, match.token_ids[:nodes], None, (method, match.match_length),
                                 parents=match.parents[:nodes] if match.parents else None)
                return

    def _row_price(self, running: list[Sequence], rows: int) -> float:
        """The guard's price of `rows` more rows in the coming pass: the running batch's
        tokens with every draft chosen so far."""
        return self.guard.row_price(len(running), sum(
            max(s.num_draft_tokens, 0) for s in running) + len(running), rows)

    def _windows(self, running: list[Sequence], seqs: list[Sequence]) -> None:
        """Lookahead decoding's window rows after the free drafts (or none) of `seqs`, where
        the guard's price of a row (at the batch's size) is below the rows' measured value;
        never under a grammar (the rows' guesses would need its masks)."""
        price: float | None = None
        for seq in seqs:
            state = self._state(seq)
            if state.lookahead:  # a window left from a step that did not schedule it
                keep = len(state.drafts) - state.lookahead
                state.drafts, state.lookahead = state.drafts[:keep], 0
                state.parents = state.parents[:keep] if keep else None
                state.confidence = (state.confidence[:keep] if state.confidence is not None
                                    else None)
                seq.num_draft_tokens = keep
            k = len(state.drafts or [])
            if (seq.matcher is not None or state.device is not None or state.q is not None
                    or self.lookahead.width == 0):  # (windows follow one-hot drafts only)
                continue
            if price is None:
                rows = self.lookahead.width * (self.lookahead.n - 1)
                price = self._row_price(running, rows)
            if not self.lookahead.window_pays(seq, price):
                continue
            ids, parents = self.lookahead.window(seq, k, min(
                MAX_TREE_NODES, self.max_model_len - seq.num_tokens) - k)
            if not ids:
                continue
            tree = state.parents if state.parents is not None else list(range(-1, k - 1))
            state.drafts, state.parents = (state.drafts or []) + ids, tree + parents
            state.lookahead = len(ids)
            seq.num_draft_tokens = k + len(ids)
            if state.confidence is not None:
                state.confidence = state.confidence + [0.0] * len(ids)

    def _free(self, seq: Sequence, room: int, trees: bool) -> tuple[SuffixDraft, str]:
        """The sequence's free proposal and its method: its suffix match (a tree of its
        continuations where `trees`), the lookahead pool's continuations or its prediction's,
        whichever expects more accepted tokens."""
        best, method = SuffixDraft(), "suffix"
        if self.suffix is not None and trees:  # its nodes' slots in the context
            best = self.suffix.propose_tree(seq, room, min(self.tree_nodes, self.max_model_len
                                                           - seq.num_tokens))
        elif self.suffix is not None:
            best = self.suffix.propose(seq, room)
        if self.lookahead is not None:
            pool = self.lookahead.propose(seq, room, min(
                self.lookahead.g * (self.lookahead.n - 1), self.max_model_len - seq.num_tokens))
            if sum(pool.confidence) > sum(best.confidence):
                best, method = pool, "lookahead"
        if seq.params.prediction:
            state = self._state(seq)
            if state.prediction is None:
                state.prediction = PredictionMatcher(seq.params.prediction)
            own = state.prediction.propose(seq.output_token_ids,
                                           min(room, self.config.suffix_max_spec_tokens))
            if sum(own.confidence) > sum(best.confidence):
                best, method = own, "prediction"
        return best, method

    def _proposer_tree_ok(self, seq: Sequence) -> bool:
        """The proposer drafts a token tree for the sequence (a head, the draft model; trees
        on): of its most probable tokens where the target's own pick verifies it (greedy,
        coupled seeded), a sampled one (`_sampled_tree`) where rejection sampling does."""
        return (self.tree_nodes > 0 and self.proposer is not None and self.proposer.trees
                and (by_pick(seq.params, self.coupled) or self._sampled_tree(seq)))

    def _sampled_tree(self, seq: Sequence) -> bool:
        """A sequence verified by rejection sampling gets a sampled tree (children drawn from
        q without replacement, verified with q) where `sampled_trees` is on, the proposer
        drafts them, the request
        is unseeded (a seeded one's draws would need keyed streams: it keeps chains) and no
        grammar prunes the tree (a node cut for its token would bias the draws). A tree of the
        most probable tokens (one-hot) would be accepted with the target's probability of
        each, far less than sampled drafts where the distribution is flat."""
        return (self.config.sampled_trees and self.proposer is not None
                and self.proposer.sampled_trees and seq.params.seed is None and seq.matcher is None
                and not by_pick(seq.params, self.coupled))

    def _backlog(self, seq: Sequence) -> int:
        """Tokens the proposer must catch up on before it drafts for `seq`."""
        if self.proposer is not None:
            return self.proposer.backlog(seq)
        return seq.num_tokens - seq.num_draft_computed

    def _propose_with(self, seqs: list[Sequence], ks: list[int]) -> None:
        """The proposer's drafts for `seqs`, k each."""
        t0 = time.perf_counter()
        proposal = self.proposer.propose(seqs, ks)
        # read: its forwards have run; else timed once the step that verifies it reads
        self.guard.drafted(proposal, time.perf_counter() - t0 if proposal.device is None
                           else None)
        for j, (seq, q) in enumerate(zip(seqs, proposal.probs)):
            k = proposal.lengths[j]
            device = None if proposal.device is None else proposal.device[j, :k]
            self._set_drafts(seq, proposal.token_ids[j] if device is None else None, q,
                             (self.method, 0), device, k)

    def _propose_trees(self, seqs: list[Sequence], rooms: list[int], ks: list[int],
                       min_prob: float, min_level: float) -> None:
        """The proposer's token trees for `seqs`: as deep as k_max (or their room) allows, of
        at most tree_max_nodes nodes inside the context, each node at least `min_prob` likely
        (the guard's price of a row), a level only where its nodes sum to `min_level` (the
        price of a draft forward); a tree that came out a chain is verified as one. A sampled
        tree keeps the chain of the k the plan chose (`ks`) and branches beside it."""
        depths = [min(self.config.k_max, room) for room in rooms]
        caps = [min(self.tree_nodes, self.max_model_len - s.num_tokens) for s in seqs]
        sampled = [self._sampled_tree(s) for s in seqs]
        for which in (False, True):
            part = [i for i, x in enumerate(sampled) if x == which]
            if not part:
                continue
            t0 = time.perf_counter()
            if which:  # shapes from each one's acceptance estimate, drawn from q
                alphas = [self._state(seqs[i]).acceptance or 0.0 for i in part]
                shapes = [tree_draft.sampled_shape(a, self.guard.tree_width, caps[i], depths[i],
                                                   min_prob, min_level, spine=ks[i])
                          for a, i in zip(alphas, part)]
                proposal = self.proposer.propose_sampled_tree([seqs[i] for i in part], shapes,
                                                              alphas)
            else:
                proposal = self.proposer.propose_tree(
                    [seqs[i] for i in part], [depths[i] for i in part], [caps[i] for i in part],
                    self.guard.tree_width, min_prob, min_level)
            self.guard.drafted(proposal, time.perf_counter() - t0)
            for i, ids, q, parents, conf in zip(part, proposal.token_ids, proposal.probs,
                                                proposal.parents, proposal.confidence):
                self._set_drafts(seqs[i], ids, q, (self.method, 0),
                                 parents=None if is_chain(parents) else parents,
                                 confidence=conf)

    def _set_drafts(self, seq: Sequence, drafts: list[int] | None, q: torch.Tensor | None,
                    method: tuple[str, int], device: torch.Tensor | None = None,
                    k: int | None = None, parents: list[int] | None = None,
                    confidence: list[float] | None = None) -> None:
        """drafts: on the host, or None where `device` ([k]) holds them (never for a
        sequence under a grammar: the proposer reads those); parents: their token tree (on
        the host), None for a chain; a tree's q (a sampled tree's) is [1 + nodes, V]: the
        root's row, then each node's (its first rows are a chain's q where it came out one).
        Under a grammar, drafts keep what it allows: a chain to its first refused token, a
        tree the nodes whose paths it allows."""
        if seq.matcher is not None and drafts and parents is not None:
            drafts, parents, confidence = _grammar_tree(seq.matcher, drafts, parents,
                                                        confidence)
        elif seq.matcher is not None and drafts:  # structured output: drafts the grammar
            valid = seq.matcher.validate_tokens(list(drafts))  # allows, to the first not
            drafts, q = drafts[:valid], (None if q is None else q[:valid])
        k = len(drafts) if drafts is not None else k
        seq.num_draft_tokens = k
        state = self._state(seq)
        state.drafts = list(drafts) if drafts is not None else None
        state.device = device if k else None
        state.q = q if k else None
        state.parents = parents if k else None
        state.confidence = confidence if k else None
        state.method = method
        state.lookahead = 0

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still matter: before max_tokens and inside the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    # -- verification -------------------------------------------------------------------------
    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int,
                rejected: bool, tree: list[int] | None = None,
                path: list[int] | None = None) -> None:
        """tree: the verified drafts' token tree (None: a chain); path: its accepted nodes."""
        state = self._state(seq)
        method, match_length = state.method or (self.method, 0)
        state.method = None
        seq.num_drafted_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_rejections += rejected
        counts = seq.spec_methods.setdefault(method, [0, 0, 0, 0, 0])
        counts[0] += num_drafted
        counts[1] += num_accepted
        counts[2] += rejected
        if tree is not None:
            counts[3] += 1
            counts[4] += num_drafted
        self.stats.record_verification(num_drafted, num_accepted, method, tree is not None)
        if method == "prediction":  # the request's own prediction, its own acceptance
            state.prediction.record(num_drafted, num_accepted)
            return
        if method == "lookahead":  # the pool calibrates its own confidences
            self.lookahead.verified(seq, num_drafted, num_accepted, path)
            return
        if method == "suffix":  # the suffix cache calibrates its own confidences
            self.suffix.record(seq, match_length, num_drafted, num_accepted, rejected)
            return
        predicted, state.predicted = state.predicted, None
        if predicted is not None:  # the proposer's tree: its nodes' chances are calibrated
            self.guard.tree_verification(num_accepted, rejected, predicted)
            return
        self.guard.verification(num_drafted, num_accepted, state.acceptance)


def _grammar_tree(matcher, ids: list[int], parents: list[int],
                  confidence: list[float] | None
                  ) -> tuple[list[int], list[int] | None, list[float] | None]:
    """A token tree cut to the nodes whose paths the grammar allows from the matcher's state
    (a refused node's subtree goes with it), in the same order; its parents (None where what
    is left is a chain) and confidences."""
    keep: list[int] = []
    where: dict[int, int] = {}  # kept node -> its index in what is left
    for j, path in enumerate(tree_paths(parents)):
        if parents[j] != ROOT and parents[j] not in where:
            continue  # its parent was refused
        tokens = [ids[a] for a in path]
        if matcher.validate_tokens(tokens) == len(tokens):
            where[j] = len(keep)
            keep.append(j)
    kept = [ROOT if parents[j] == ROOT else where[parents[j]] for j in keep]
    return ([ids[j] for j in keep], None if is_chain(kept) else kept,
            None if confidence is None else [confidence[j] for j in keep])


def build_speculator(config: EngineConfig, plan: RunnerPlan, target: ModelRunner,
                     block_manager: BlockManager, draft_model: torch.nn.Module | None,
                     tokenizer_size: int | None, max_model_len: int,
                     draft_vocabulary: torch.Tensor | None = None,
                     head: EagleHead | MedusaHeads | None = None) -> NoSpeculation:
    """The speculation the config asks for (calibrated when adaptive), or `NoSpeculation`.
    A draft model's runner follows `plan`, as the target's does; `draft_vocabulary`: the ids a
    draft model scores (None: all); `head`: the eagle method's head (the target's runner
    captures the layers it reads); Medusa heads for the medusa method (or hybrid)."""
    speculative = config.speculative
    if not speculative.enabled:
        return NoSpeculation()
    proposer: Proposer | None = None
    if speculative.method == "ngram":
        proposer = NgramProposer(speculative.ngram_min_n, speculative.ngram_max_n)
    elif isinstance(head, MedusaHeads):
        proposer = MedusaProposer(head)
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
    lookahead = LookaheadPool(speculative.lookahead) if speculative.lookahead else None
    speculator = Speculator(speculative, proposer, max_model_len, config.max_num_batched_tokens,
                            target.device, suffix, lookahead)
    if speculative.adaptive and speculative.calibrate:
        calibrate(speculator.guard.controller, block_manager, target,
                  proposer if isinstance(proposer, EagleProposer)
                  else getattr(proposer, "runner", None))
    return speculator
