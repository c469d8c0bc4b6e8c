"""The speculation guard: how many drafts each sequence verifies next, and speculation kept only
where it pays. One object; no torch.

Must not propose, verify or hold a request's drafts: the speculator (speculator.py) keeps each
request's `SpecState` and dispatches to the proposers; it asks the guard what to draft and feeds
it what happened. The guard owns every measurement and decision of speculation's cost:
- the cost model (adaptive.py `KController`: target and draft forward costs, acceptance
  feedback) that plans k per sequence each step;
- the realized rates (adaptive.py `RealizedRates`: tokens per second speculative and plain
  steps actually reached, per batch-size class), which say per step whether to speculate,
  explore or run plain; and the same comparison of the steps whose proposer drafted token
  trees with those whose proposer drafted chains, which says per step which shape to draft
  (`trees`);
- catch-ups: a draft model's long catch-up (a prompt, or tokens emitted while it did not draft)
  is made only where it pays back (`_invest`) or, unproven, within a small share of the time
  (`_affordable`).

Fed by the speculator, each step in this order: `step(record)` with the engine's `StepRecord`
(what ran and when; its realized rate includes the proposal the step verified); where some
sequence may draft, `mode`, `trees` (where trees are on and some candidate may draft one) and
`choose` for the next proposal, and `drafted` with the proposal
where the proposer drafts; `proposed` with the propose call's time. Also per verification
(`verification`) and per finished request (`finished`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from typing import TYPE_CHECKING

from engine.config import SpeculativeConfig
from engine.sequence import Sequence
from engine.spec_decode.adaptive import AcceptanceStats, KController, RealizedRates
from engine.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:  # (a proposal is read through its methods: no torch here)
    from engine.spec_decode.proposer import Proposal

# a step whose drafts come after more tokens than a steady run leaves the draft model behind
# (the bonus token, and the last draft when all were accepted) includes a catch-up
CATCH_UP_TOKENS = 2
OUTPUT_ALPHA = 0.1  # weight of a finished request's output length in the running mean
# a catch-up of the draft model that no measured saving justifies (exploring where speculation
# measured slower, or where it has not been measured yet) may take at most this share of the
# time since the last catch-up; the sequences behind otherwise speculate without the draft model
UNPROVEN_CATCH_UP_SHARE = 0.03


@dataclass
class StepRecord:
    """One engine step as the guard reads it: what ran, and when."""

    started: float  # the host clock (perf_counter) when the step began: its scheduling
    num_tokens: int  # tokens of the target pass
    num_seqs: int  # sequences of the target pass
    verified: list[tuple[int, int]]  # per sequence that sampled: (drafts verified, accepted)
    marks: object  # device_io.Marks: the clock of the target pass, from ...
    target_start: object  # ... its start (before its forward) ...
    target_end: object | None  # ... to the step's read (None: unknown, CUDA without a read)

    def target_seconds(self) -> float | None:
        """The target pass with its verification (None when unknown)."""
        if self.target_end is None:
            return None
        return self.marks.seconds(self.target_start, self.target_end)


@dataclass
class _LastProposal:
    """The proposal the coming step verifies: what it cost beyond that step."""

    seconds: float = 0.0  # the propose call (paid by the step that verifies it)
    backlogs: list[int] = field(default_factory=list)  # its drafting sequences' catch-ups
    unread: Proposal | None = None  # its draft forwards, when the device has not run them yet
    trees: bool | None = None  # its shape where `trees` chose one: token trees, or chains


class Choice(NamedTuple):
    """The plan for the next step's candidates: k of the proposer (draft model, head, prompt
    lookup) and k of their free proposals (a suffix match or the request's prediction; at most
    one of the two nonzero), and the
    acceptance estimate each sequence's k was chosen on (none in a plain step)."""

    draft_ks: list[int]
    suffix_ks: list[int]
    acceptance: list[float]
    # the proposer's token trees (`tree_prices` turns these into its probabilities): the
    # least calibrated chance of acceptance that pays for a node's row, and the accepted
    # tokens one more level must be expected to add to pay for its draft forward
    node_threshold: float = 0.0
    level_price: float = 0.0


class Guard:
    def __init__(self, config: SpeculativeConfig, stats: SpecDecodeStats, method: str,
                 has_proposer: bool, has_suffix: bool, max_num_batched_tokens: int) -> None:
        """method: the proposer's ("draft_model", "eagle", "medusa", "ngram"); has_proposer: it is
        served (False: suffix only); stats: where the choices and draft time are counted."""
        self.config = config
        self.stats = stats
        self.method = method
        self.has_proposer = has_proposer
        self.has_suffix = has_suffix
        self.budget = max_num_batched_tokens
        self.controller = KController(config.k_max, config.adaptive,
                                      draft_cost_free=method in ("ngram", "medusa"))
        self.realized = RealizedRates()
        # the proposers' token trees (the "speculative" side) against their chains (the "plain"
        # side): the same comparison, over the speculative steps where a tree was possible. A
        # tree's gain over a chain is smaller and its steps vary more than speculation's over
        # plain decoding: a slower decay weighs more steps
        self.shapes = RealizedRates(decay=0.95)
        self._last = _LastProposal()
        self._mean_output: float | None = None  # output tokens of recently finished requests
        self._since_catch_up = math.inf  # seconds of steps since a draft model catch-up
        self._tree_sums = [0.0, 0.0]  # the proposer's trees: accepted, predicted (decayed)
        # a proposer's tree (a head's, the draft model's) expands this many nodes per level,
        # this many children each
        self.tree_width = max(2, min(8, config.tree_max_nodes // 4))

    # -- what happened ------------------------------------------------------------------------
    def step(self, record: StepRecord, now: float) -> None:
        """The step that just committed its tokens (`now`: the host clock after it): its target
        pass's cost, and for a pure decode step its realized rate: its wall time and the
        proposal it verified, less the part of that proposal's catch-up a steady run does not
        pay. The proposal's forwards left on the device are timed now (the step's read waited
        for them)."""
        last = self._last
        if last.unread is not None:
            self._record_forwards(last.unread)
            self.stats.draft_seconds += last.unread.device_seconds()
        self._since_catch_up += now - record.started
        seconds = record.target_seconds()
        if seconds is not None:
            self.controller.target_cost.record(record.num_tokens, record.num_seqs, seconds)
        drafted = sum(d for d, _ in record.verified)
        if seconds is not None and len(record.verified) == record.num_seqs \
                and record.num_tokens == record.num_seqs + drafted:  # a pure decode step
            excess = self._catch_up_seconds(last.backlogs) if drafted else 0.0
            # (on CUDA the proposal's estimate may exceed what the wall clock saw of it)
            wall = now - record.started + last.seconds
            tokens = sum(a + 1 for _, a in record.verified)
            self.realized.record(record.num_seqs, drafted > 0, tokens,
                                 max(wall - excess, 0.5 * wall))
            if drafted and last.trees is not None:
                self.shapes.record(record.num_seqs, last.trees, tokens,
                                   max(wall - excess, 0.5 * wall))
        self._last = _LastProposal()

    def verification(self, num_drafted: int, num_accepted: int,
                     acceptance: float | None) -> None:
        """One sequence verified drafts of the proposer (`acceptance`: the estimate its k was
        chosen on)."""
        self.controller.record_verification(
            num_drafted, num_accepted,
            None if acceptance is None else self.controller.predicted_accepted(acceptance,
                                                                               num_drafted))

    def tree_verification(self, num_accepted: int, rejected: bool, predicted: float) -> None:
        """One sequence verified a token tree of the proposer whose nodes' chances summed to
        `predicted` (the accepted tokens a tree is expected to give): calibrates them
        (`tree_scale`); the acceptance prior counts it as a chain that went on past its
        accepted path where it was rejected."""
        self.controller.record_verification(num_accepted + rejected, num_accepted)
        d = self.controller.feedback_decay
        self._tree_sums = [self._tree_sums[0] * d + num_accepted,
                           self._tree_sums[1] * d + predicted]

    @property
    def tree_scale(self) -> float:
        """Accepted tokens realized / predicted by the proposer's tree nodes' probabilities
        over recent trees (1 until there is evidence): a head's confidence is not its
        acceptance."""
        realized, predicted = self._tree_sums
        if predicted < 8.0:
            return 1.0
        return min(max(realized / predicted, 0.25), 2.0)

    def tree_prices(self, choice: Choice) -> tuple[float, float]:
        """Under the proposer's own probabilities: the least a tree node needs to be verified,
        and the least the nodes a level expands must sum to for the level to be drafted."""
        return (min(choice.node_threshold / self.tree_scale, 1.0),
                choice.level_price / self.tree_scale)

    def finished(self, num_output_tokens: int) -> None:
        """A request finished (not aborted) with this many output tokens."""
        n = num_output_tokens
        self._mean_output = n if self._mean_output is None else \
            self._mean_output + OUTPUT_ALPHA * (n - self._mean_output)

    def drafted(self, proposal: Proposal, seconds: float | None) -> None:
        """The proposer's drafts for the next step; `seconds`: its forwards' time where they
        have run (None: left on the device, timed by the step that reads it)."""
        if seconds is None:
            self._last.unread = proposal
            return
        self.stats.draft_seconds += seconds
        self._record_forwards(proposal)

    def proposed(self, seconds: float) -> None:
        """The propose call took `seconds` (the step that verifies its drafts pays them)."""
        self._last.seconds = seconds

    def _record_forwards(self, proposal: Proposal) -> None:
        for num_tokens, num_seqs, seconds in proposal.forward_seconds():
            self.controller.draft_cost.record(num_tokens, num_seqs, seconds)

    def row_price(self, num_running: int, num_tokens: int, rows: int) -> float:
        """The accepted tokens `rows` more rows must bring per row to pay for themselves in a
        pass of `num_tokens` tokens over `num_running` sequences: the target's marginal seconds
        per token at that size times plain decoding's rate there (0 before a cost is measured,
        or where k is not adaptive)."""
        cost = self.controller.target_cost
        if not self.config.adaptive or cost.empty or not num_running:
            return 0.0
        plain = num_running / max(cost(num_running, num_running), 1e-9)
        return cost.slope(num_tokens, rows) * plain

    # -- what to draft ------------------------------------------------------------------------
    def mode(self, num_running: int) -> str:
        """"speculate", "explore" or "plain" for the next step of the running batch (each
        call counts as one such step)."""
        return self.realized.decide(num_running) if self.config.adaptive else "speculate"

    def trees(self, num_running: int) -> bool:
        """Whether the proposers draft token trees in the next step (else chains), for a
        running batch of `num_running` where trees are on and some candidate may draft one
        (each call counts as one such step): trees until the steps that drafted them realized
        fewer tokens per second than the steps that drafted chains at this batch size, then
        chains, with a few tree steps now and then to notice a change (`RealizedRates.decide`
        over the two shapes). Always trees where k is not adaptive."""
        trees = not self.config.adaptive or self.shapes.decide(num_running) != "plain"
        self._last.trees = trees
        if not trees:
            self.stats.num_chain_steps_chosen += 1
        return trees

    def no_shape(self) -> None:
        """The step `trees` chose a shape for drafted nothing the shape applies to (the plan
        left the tree-capable sources out): its rate is neither shape's."""
        self._last.trees = None

    def choose(self, running: list[Sequence], candidates: list[Sequence], rooms: list[int],
               num_joining: int, free: list[list[float]] | None, mode: str,
               backlog_of: Callable[[Sequence], int]) -> Choice:
        """k per candidate, cut to `rooms` (the drafts each has room for). free: per candidate
        the confidences of its suffix proposal (None: no suffix proposals); mode: `mode`'s
        answer for this step; backlog_of(seq): tokens the proposer must catch up on."""
        ctl = self.controller
        n = len(candidates)
        if mode == "plain":  # measured: plain steps are faster here (or being measured)
            self._last.backlogs = []
            ctl.decay_evidence()  # old evidence must not keep k at 0 for good
            self.stats.record_choice([0] * n)
            return Choice([0] * n, [0] * n, [])
        alphas = [self._alpha(s, ctl.prior_acceptance) for s in candidates]
        others = [s for s in running if s not in candidates]
        backlog = [self._backlog(backlog_of(s)) for s in candidates]
        remaining = [self._expected_remaining(s, room) + 1 for s, room in zip(candidates, rooms)]
        plan = self._planned(running, others, alphas, backlog, remaining, num_joining, free,
                             mode)
        draft_ks = [min(k, room) for k, room in zip(plan[0], rooms)]
        prices = (0.0, 0.0)  # (a tree's: only where the proposer may draft one)
        if self.config.tree_max_nodes and self.has_proposer and any(draft_ks):
            prices = ctl.tree_prices(alphas, draft_ks, plan[2], len(others), self.tree_width)
        drafting = [b for k, b in zip(draft_ks, backlog) if k > 0]
        if any(b > CATCH_UP_TOKENS for b in drafting):
            self._since_catch_up = 0.0
        self._last.backlogs = drafting
        if not any(draft_ks):  # a step without drafts: old evidence must not keep k at 0 for good
            ctl.decay_evidence()
        self.stats.record_choice([max(a, b) for a, b in zip(draft_ks, plan[1])])
        return Choice(draft_ks, plan[1], alphas, *prices)

    def _planned(self, running: list[Sequence], others: list[Sequence], alphas: list[float],
                 backlog: list[int], remaining: list[int], num_joining: int,
                 free: list[list[float]] | None, mode: str
                 ) -> tuple[list[int], list[int], int]:
        """(proposer k, suffix k) per candidate from the cost model, with the catch-ups it
        may make (before the rooms cut them), and the tokens the pass computes for others."""
        ctl = self.controller
        other_tokens = sum(min(s.num_uncomputed_tokens, self.budget) for s in others)
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
        if free is None:
            draft_ks = ctl.choose(alphas, other_tokens, plan_backlog, remaining, pending,
                                  len(others))
            suffix_ks = [0] * len(alphas)
        else:
            draft_ks, suffix_ks = ctl.choose_hybrid(
                alphas, free, other_tokens, plan_backlog, remaining, pending, len(others),
                draft=self.has_proposer)
        if mode == "speculate" and measured:
            draft_ks = self._invest(draft_ks, backlog, remaining, len(running))
        elif not affordable:  # speculate only where the draft is caught up
            draft_ks = [0 if b > CATCH_UP_TOKENS else k for k, b in zip(draft_ks, backlog)]
        return draft_ks, suffix_ks, other_tokens

    def _alpha(self, seq: Sequence, prior: float) -> float:
        """The sequence's acceptance estimate for the proposer."""
        _, accepted, rejections, *_ = seq.spec_methods.get(self.method, (0, 0, 0))
        return AcceptanceStats(accepted, rejections).estimate(prior)

    def _backlog(self, backlog: int) -> int:
        """A proposer's backlog as a catch-up: a head (and a draft model drafting token trees)
        runs its rows of the last verification's accepted tokens every step (up to k_max + 1,
        costed like a steady draft step); more is a catch-up (a prompt)."""
        steady = self.method == "eagle" or self.config.tree_max_nodes > 0
        if steady and backlog <= self.config.k_max + 1:
            return min(backlog, CATCH_UP_TOKENS)
        return backlog

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
        if not n or not self.has_proposer or self.controller.draft_cost_free:
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
