"""How a sequence's next position is sampled, and how its drafts are verified: pure functions.

Must not hold state: the verifier (the target's rows) and the draft model (its own rows) ask
the same questions here, so both sample from the same processed distribution.
"""

from __future__ import annotations

from engine.sample import keys
from engine.sample.sampler import GrammarRow, RowSpec
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def row_spec(seq: Sequence, j: int, drafts: list[int] | None = None,
             stream: int = keys.RACE) -> RowSpec:
    """How to sample the position after the sequence's first j drafts (they count as generated
    tokens); a seeded request's noise there is keyed by (seed, position, stream). drafts: the
    sequence's drafts on the host (at least j), which a row that reads them needs (penalties,
    a grammar); None where only the device holds them."""
    if drafts is None:
        assert j == 0 or (seq.matcher is None and not seq.params.has_penalties), \
            "this row reads its drafts: they must be on the host"
        pending: list[int] = []
    else:
        pending = list(drafts[:j])
    history = seq.output_token_ids + pending if pending else seq.output_token_ids
    position = seq.num_output_tokens + j
    seed = seq.params.seed
    key = None if seed is None else keys.noise_key(seed, position, stream)
    grammar = None if seq.matcher is None else GrammarRow(seq.grammars, seq.matcher, pending)
    return RowSpec(seq.params, seq.prompt_token_ids, history, key, grammar)


def by_pick(params: SamplingParams, coupled: bool) -> bool:
    """Verified by the target's own pick: greedy, or seeded sampling under coupled verification
    (both emit exactly the tokens plain decoding would); the drafts' q is then never read."""
    return params.greedy or (coupled and params.seed is not None)


def draft_stream(coupled: bool) -> int:
    """The noise stream a draft model samples a seeded request with: under coupled
    verification the target's own race (so the draft picks what the target would when the two
    agree); otherwise a stream of its own."""
    return keys.RACE if coupled else keys.DRAFT
