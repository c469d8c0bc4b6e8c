"""Lookahead decoding: the n-gram pool and the Jacobi window (engine/spec_decode/lookahead.py),
exact serving alone and in hybrid, the lookahead rows blind to the verification branch, bad
configs."""

import math

import pytest
import torch

from conftest import (build_tiny_model, make_engine, random_prompts, same_distribution_pvalue,
                      staggered, third_tokens)
from engine import SamplingParams
from engine.batch import ROOT, Drafts
from engine.config import LookaheadConfig, SpeculativeConfig
from engine.sequence import Sequence
from engine.spec_decode.lookahead import (POOL_PROBE_SHARE, PRIOR_ROW_VALUE, PROBE_SHARE,
                                         LookaheadPool)
from test_eagle import grammar_exactness

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts():
    base = random_prompts([12, 7, 20, 30], seed=9)
    return [b * 3 for b in base[:2]] + base[2:] + random_prompts([3, 40], seed=4)


def test_the_pool_proposes_the_last_tokens_continuations_as_a_tree():
    pool = LookaheadPool(LookaheadConfig(window=0, ngram=3, max_candidates=3))
    seq = Sequence("r", [1, 2, 3, 9, 1, 2, 4, 9, 1, 5, 6, 9, 1], SamplingParams())
    draft = pool.propose(seq, room=8, max_nodes=16)
    # the n-grams after 1: (2, 3), (2, 4), (5, 6); after 9: (1, 2), (1, 5)...: key 1 here
    paths = {tuple(draft.token_ids[j] for j in _path(draft.parents, i))
             for i in range(len(draft.token_ids))}
    assert paths == {(2,), (2, 3), (2, 4), (5,), (5, 6)}
    assert draft.confidence == sorted(draft.confidence, reverse=True)
    assert all(p == ROOT or p < i for i, p in enumerate(draft.parents))
    # the shared first token (2) counts twice: likelier than the single one (5)
    assert draft.confidence[draft.token_ids.index(2)] > draft.confidence[draft.token_ids.index(5)]
    assert len(pool.propose(seq, room=8, max_nodes=2).token_ids) == 2


def _path(parents, i):
    out = [i]
    while parents[out[-1]] != ROOT:
        out.append(parents[out[-1]])
    return out[::-1]


def test_the_window_is_a_tree_of_columns_and_its_trajectories_fill_the_pool():
    width, n = 3, 3
    pool = LookaheadPool(LookaheadConfig(window=width, ngram=n, max_candidates=2))
    seq = Sequence("r", [7, 8, 9], SamplingParams())
    ids, parents = pool.window(seq, first_node=2, max_nodes=64)
    assert len(ids) == width and parents == [ROOT, 2, 3]  # level 0: a chain after 2 nodes
    pool.stepped(seq, width, [20, 21, 22])  # the target's argmax at each row: level 1
    ids, parents = pool.window(seq, first_node=0, max_nodes=64)
    assert ids[width:] == [20, 21, 22]
    assert parents == [ROOT, 0, 1, 0, 1, 2]  # level 1's token i: the child of level 0's i
    pool.stepped(seq, 2 * width, [0, 0, 0, 30, 31, 32])  # level 2: columns of 3 guesses
    level0 = ids[:width]
    for i in range(width):  # each column (guesses at 3 consecutive positions) is an n-gram
        assert (((20 + i, 30 + i), "window")
                in pool._requests["r"].pool.get(level0[i], 4))
    # the oldest level dropped: the window slid one position; a committed token aligns it
    seq.token_ids.append(5)
    ids, _ = pool.window(seq, first_node=0, max_nodes=64)
    assert ids[:width] == [20, 21, 22] and ids[width:] == [30, 31, 32]
    assert pool.window(seq, first_node=0, max_nodes=5) == ([], [])  # too large: restarts


def test_window_rows_run_only_where_their_measured_value_beats_the_guards_price():
    width, n = 2, 3
    pool = LookaheadPool(LookaheadConfig(window=width, ngram=n, max_candidates=2))
    seq = Sequence("r", [7, 8, 9], SamplingParams())
    assert pool.row_value == PRIOR_ROW_VALUE  # nothing measured yet: the prior
    assert pool.window_pays(seq, price=0.0)  # free rows (a GPU at batch 1) run
    for _ in range(200):  # window steps whose n-grams never got accepted
        ids, _ = pool.window(seq, first_node=0, max_nodes=64)
        pool.stepped(seq, len(ids), [1] * len(ids))
    assert pool.row_value < PRIOR_ROW_VALUE / 5
    assert pool.window_pays(seq, price=0.0)
    other = Sequence("s", [7, 8], SamplingParams())
    rows = width * (n - 1)
    for price in (0.05, 0.5):  # priced out: probes paid from PROBE_SHARE per sequence-step
        runs = [pool.window_pays(s, price=price) for _ in range(2000)
                for s in (seq, other)]  # the server's sequence-steps, two sequences
        every = math.ceil(rows * price / PROBE_SHARE)  # sequence-steps a probe's credit takes
        assert sum(runs) == len(runs) // every
        # one sequence at a time, never two probes in a row: the rows' cost stays PROBE_SHARE
        assert not any(a and b for a, b in zip(runs, runs[1:]))
        spent = sum(runs) * rows * price
        assert PROBE_SHARE * len(runs) * 0.9 <= spent <= PROBE_SHARE * len(runs)
    assert LookaheadPool(LookaheadConfig(window=0)).window_pays(seq, price=0.0) is False


def test_priced_out_pool_proposals_are_probed_from_a_small_share():
    pool = LookaheadPool(LookaheadConfig(window=0, ngram=4))
    assert not pool.probe(3, price=0.0)  # unpriced rows: the plan drafts whatever pays
    for nodes, price in ((3, 0.05), (2, 0.4)):
        runs = [pool.probe(nodes, price) for _ in range(3000)]
        every = math.ceil(nodes * price / POOL_PROBE_SHARE - 1e-9)  # calls a probe takes
        assert sum(runs) == len(runs) // every
        spent = sum(runs) * nodes * price  # at most the share of what the calls stand for
        assert POOL_PROBE_SHARE * len(runs) * 0.9 <= spent <= POOL_PROBE_SHARE * len(runs)


def test_a_pool_the_plan_prices_out_is_still_verified_and_learns(monkeypatch):
    """Where the plan prices every pool proposal out (after a workload where the pool's n-grams
    missed, its shared chances are low), probes verify some anyway, at most one sequence a
    step, so the chances can rise where the n-grams hit (repeated text); the output stays
    plain's."""
    target = build_tiny_model(dtype=torch.bfloat16)
    prompts = _prompts()
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=40,
                                     ignore_eos=True)] * 3  # greedy and seeded, batched
    plain = staggered(make_engine(target, dtype="bfloat16"), prompts, params)
    engine = make_engine(target, "lookahead", adaptive=True, dtype="bfloat16",
                         lookahead={"window": 0})
    guard = engine.speculator.guard
    monkeypatch.setattr(guard, "row_price", lambda *a: 0.05)
    planned = guard.choose
    monkeypatch.setattr(guard, "choose", lambda *a: planned(*a)._replace(
        suffix_ks=[0] * len(a[1])))  # (a[1]: the candidates) every proposal priced out
    pool = engine.speculator.lookahead
    for source in ("text", "window"):  # missed nearly every time, over a long history
        pool.hits[source] = [1.0] * pool.n
        pool.trials[source] = [1e6] * pool.n
    drafting = []
    step = engine.step

    def counted():
        drafting.append(sum(s.num_draft_tokens > 0 for s in engine.scheduler.running))
        return step()

    engine.step = counted
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    verifications, _, accepted = engine.speculator.stats.by_method["lookahead"]
    assert verifications == pool.pool_probes > 0 and max(drafting) == 1
    assert accepted > 0 and pool.hits["text"][0] > 1.0  # its shared chances learned the hits


def test_the_pools_chances_are_calibrated_per_source():
    pool = LookaheadPool(LookaheadConfig(window=2, ngram=3, max_candidates=4))
    seq = Sequence("r", [1, 2, 3, 1], SamplingParams())
    pool._request(seq).pool.add(1, (8, 9), "window")
    for _ in range(50):  # the text's n-gram (1 -> 2, 3) always accepted, the window's never
        draft = pool.propose(seq, room=4, max_nodes=8)
        text = draft.token_ids.index(2)
        pool.verified(seq, len(draft.token_ids), 2, [text, draft.token_ids.index(3)])
    draft = pool.propose(seq, room=4, max_nodes=8)
    chance = dict(zip(draft.token_ids, draft.confidence))
    assert chance[2] > 0.4 and chance[3] > 0.4 and chance[8] < 0.1 and chance[9] < 0.1


@pytest.mark.parametrize("adaptive", [False, True])
def test_lookahead_greedy_and_seeded_equal_plain_in_a_staggered_batch(adaptive):
    target = build_tiny_model(dtype=torch.bfloat16)
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)] * 3
    plain = staggered(make_engine(target, dtype="bfloat16"), prompts, params)
    engine = make_engine(target, "lookahead", adaptive=adaptive, dtype="bfloat16")
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    st = engine.speculator.stats
    assert st.by_method["lookahead"][2] > 0  # the pool's n-grams were accepted
    assert st.tree_verifications_by_method.get("lookahead", 0) > 0
    if not adaptive:  # rows are free without a cost model: the window runs
        assert engine.speculator.lookahead.window_rows > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.speculator.num_states == 0 and not engine.speculator.lookahead._requests


def test_lookahead_in_hybrid_beside_a_draft_model_and_suffix_matches():
    target = build_tiny_model()
    draft = build_tiny_model(seed=3, num_layers=1)
    prompts = _prompts()
    plain = make_engine(target).generate(prompts, GREEDY)
    engine = make_engine(target, "hybrid", draft=draft, lookahead={"window": 3, "ngram": 3},
                         suffix_cross_request=False)
    spec = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    by = engine.speculator.stats.by_method
    assert by.get("lookahead", [0])[0] > 0 and engine.speculator.lookahead.window_rows > 0


def test_lookahead_stays_exact_with_preemption_and_after_prefix_cache_hits():
    target = build_tiny_model()
    shared = random_prompts([40], seed=3)[0]
    prompts = [shared + p for p in random_prompts([5, 9, 2, 14, 7, 3], seed=5)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(target).generate(prompts, greedy)
    engine = make_engine(target, "lookahead", num_blocks=24, block_size=8)
    first = engine.generate(prompts[:1], greedy)
    rest = engine.generate(prompts[1:], greedy)
    assert [o.output_token_ids for o in first + rest] == [o.output_token_ids for o in plain]
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.block_manager.prefix_stats.hits > 0
    assert engine.speculator.lookahead.window_rows > 0


def test_sampled_lookahead_keeps_the_targets_distribution():
    """Unseeded sampling: the pool's trees (and bare window steps) verified by rejection."""
    target = build_tiny_model("qwen2", num_layers=1)
    with torch.no_grad():  # peaked enough that the pool's n-grams are often accepted
        target.lm_head.weight.mul_(6.0)
    prompt = random_prompts([6], seed=2)[0]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # the target's own greedy text in the prompt: its n-grams are likely continuations
    prompt = prompt + make_engine(target).generate([prompt], greedy)[0].output_token_ids
    n = 2400

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)

    plain = third_tokens(make_engine(target), prompt, [params(s) for s in range(n)])
    engine = make_engine(target, "lookahead", verification="rejection",
                         lookahead={"window": 4, "ngram": 2, "max_candidates": 4})
    spec = third_tokens(engine, prompt, [params(s) for s in range(n, 2 * n)])
    assert engine.speculator.stats.num_accepted_tokens > 100
    assert engine.speculator.lookahead.window_rows > 0
    assert same_distribution_pvalue(plain, spec) > 0.001


def test_lookahead_under_a_grammar_stays_exact():
    engine = grammar_exactness("lookahead", None, 0)
    assert engine.speculator.stats.by_method["lookahead"][0] > 0


def test_lookahead_rows_never_touch_the_verification_rows_or_the_output(monkeypatch):
    """The window's rows replaced by random tokens in the forward (the pool fed from the text
    only, so both runs propose the same n-grams): the verification rows' logits are
    bit-identical, and so is the output; the window rows' own logits differ."""
    from engine.spec_decode import speculator as speculator_module

    monkeypatch.setattr(LookaheadPool, "stepped", lambda self, seq, n, outputs: None)
    target = build_tiny_model(dtype=torch.bfloat16)
    prompts = _prompts()[:3]

    def run(perturb_seed):
        engine = make_engine(target, "lookahead", dtype="bfloat16")
        g = torch.Generator().manual_seed(perturb_seed)
        take, verify = engine.speculator.take, engine.verifier.verify
        seen = {"verified": [], "window": []}

        def perturbed_take(out):
            drafts = take(out)
            if drafts is not None and perturb_seed:
                for i, n in enumerate(drafts.num_lookahead):
                    hi = drafts.offsets[i + 1]
                    fake = torch.randint(2, 320, (n,), generator=g)
                    drafts.token_ids[hi - n:hi] = fake.to(drafts.token_ids.device)
                    drafts.host[hi - n:hi] = fake.tolist()
            return drafts

        def recording_verify(seqs, logits, offsets, drafts, masks=None):
            for i in range(len(seqs)):
                lo = offsets[i]
                kv = drafts.num_verified(i) if drafts is not None else 0
                seen["verified"].append(logits[lo:lo + 1 + kv].clone())
                seen["window"].append(logits[lo + 1 + kv:offsets[i + 1]].clone())
            return verify(seqs, logits, offsets, drafts, masks)

        engine.speculator.take, engine.verifier.verify = perturbed_take, recording_verify
        outs = engine.generate(prompts, GREEDY)
        assert engine.speculator.stats.num_accepted_tokens > 0
        return [o.output_token_ids for o in outs], seen

    assert speculator_module.Drafts is Drafts
    tokens, seen = run(0)
    tokens_p, seen_p = run(1)
    assert tokens_p == tokens
    assert len(seen["verified"]) == len(seen_p["verified"])
    assert all(torch.equal(a, b) for a, b in zip(seen["verified"], seen_p["verified"]))
    windows = [(a, b) for a, b in zip(seen["window"], seen_p["window"]) if len(a)]
    assert windows and not all(torch.equal(a, b) for a, b in windows)


@pytest.mark.parametrize("options,message", [
    ({"window": -1}, "lookahead.window"),
    ({"ngram": 1}, "lookahead.ngram"),
    ({"max_candidates": 0}, "lookahead.max_candidates"),
    ({"window": 16, "max_candidates": 8, "ngram": 4}, "72 rows"),
    ({"size": 3}, "speculative.lookahead"),
])
def test_bad_lookahead_configs_name_the_option(options, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        SpeculativeConfig(method="lookahead", lookahead=options)


def test_a_lookahead_section_needs_a_method_that_uses_it():
    with pytest.raises(ValueError, match="speculative config lookahead: method ngram"):
        SpeculativeConfig(method="ngram", lookahead={"window": 3})
    assert SpeculativeConfig(method="lookahead").lookahead == LookaheadConfig()
