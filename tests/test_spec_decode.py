"""Speculative decoding in the engine: exactness, distribution, rollback, adaptive k, config."""

import copy

import pytest

from conftest import (build_tiny_model, clone_model, distribution_pair, make_engine,
                      random_prompts, same_distribution_pvalue, staggered, third_tokens)
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig
from engine.spec_decode.adaptive import CostTable, KController, expected_tokens
from engine.spec_decode.ngram import ngram_lookup

LENGTHS = [3, 50, 17, 90, 8, 33, 1, 64]


def repetitive_prompts():
    """Prompts that repeat themselves, so prompt lookup has something to find."""
    base = random_prompts([12, 7, 20, 5], seed=9)
    return [b * 4 for b in base] + random_prompts([30, 9, 44, 16], seed=10)


@pytest.mark.parametrize("draft_kind", ["copy", "different", "ngram"])
def test_greedy_with_speculation_equals_without(draft_kind):
    target = build_tiny_model("qwen2")
    prompts = random_prompts(LENGTHS) if draft_kind != "ngram" else repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(prompts)
    plain = staggered(make_engine(target), prompts, params)
    if draft_kind == "ngram":
        engine = make_engine(target, "ngram", k_max=5)
    else:
        draft = target if draft_kind == "copy" else build_tiny_model("qwen2", seed=1)
        engine = make_engine(target, "draft_model", draft)
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    st = engine.speculator.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens <= st.num_draft_tokens
    if draft_kind == "copy":
        assert st.acceptance_rate > 0.95  # a copy of the target agrees everywhere
    if draft_kind == "different":
        assert st.acceptance_rate < 0.5  # different weights: much is rejected
    assert sum(o.num_drafted_tokens for o in spec) == st.num_draft_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_with_penalties_and_stop_inside_accepted_runs():
    target = build_tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=7 + i, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5)
              for i in range(len(prompts))]
    plain = staggered(make_engine(target), prompts, params)
    engine = make_engine(target, "draft_model", target, k_max=6)
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert all(len(o.output_token_ids) == 7 + i for i, o in enumerate(spec))


@pytest.mark.parametrize("top_p,stop_confidence", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.003)])
def test_sampled_distribution_matches_plain_engine(top_p, stop_confidence):
    target, draft, prompt = distribution_pair()
    n = 2400

    def params(seed):
        # 4 tokens: the verification after the prompt has room for 2 drafts, so the 3rd token
        # is the one after a draft, wherever the draft was cut short or rejected
        return SamplingParams(temperature=1.0, top_p=top_p, max_tokens=4, seed=seed,
                              ignore_eos=True)

    plain = third_tokens(make_engine(target), prompt, [params(s) for s in range(n)])
    # seeded requests verified by rejection sampling (coupled verification has its own test)
    engine = make_engine(target, "draft_model", draft, k_max=3, stop_confidence=stop_confidence,
                         verification="rejection")
    spec = third_tokens(engine, prompt, [params(s) for s in range(n, 2 * n)])
    st = engine.speculator.stats
    assert 0.05 < st.acceptance_rate < 0.99  # drafts were both accepted and rejected
    per_draft = st.num_draft_tokens / st.num_drafts
    if stop_confidence:  # the draft stopped early on some sequences, not on all
        assert 1.05 < per_draft < 1.75
    else:
        assert per_draft > 1.75  # 2 drafts, then 1 where the first verification left room
    assert same_distribution_pvalue(plain, spec) > 0.001


@pytest.mark.parametrize("num_blocks", [256, 20])
def test_no_block_leak_with_and_without_preemption(num_blocks):
    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", seed=1)
    engine = make_engine(target, "draft_model", draft, num_blocks=num_blocks, block_size=8,
                         max_num_seqs=16)
    prompts = random_prompts([10 + 5 * i for i in range(12)], seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = engine.generate(prompts, greedy)
    plain = make_engine(target).generate(prompts, greedy)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    if num_blocks == 20:
        assert engine.scheduler.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == num_blocks
    assert engine.speculator.num_states == 0


def test_draft_stops_early_where_it_is_unsure_and_stays_exact():
    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", seed=1)
    prompts = random_prompts(LENGTHS)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = staggered(make_engine(target), prompts, greedy)
    per_draft = {}
    for stop in (0.0, 0.05):  # the tiny random draft is rarely sure of anything
        engine = make_engine(target, "draft_model", draft, k_max=6, stop_confidence=stop)
        spec = staggered(engine, prompts, greedy)
        assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
        st = engine.speculator.stats
        per_draft[stop] = st.num_draft_tokens / st.num_drafts
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert per_draft[0.0] > 5.0  # k_max minus the drafts cut short by max_tokens
    assert 1.2 < per_draft[0.05] < per_draft[0.0] - 1.0


def test_int8_draft_stays_exact():
    target = build_tiny_model("qwen2")
    spec = SpeculativeConfig(method="draft_model", draft_model="in-memory", k_max=4,
                             adaptive=False, draft_quantization="int8")
    engine = LLMEngine(EngineConfig(num_blocks=256, speculative=spec), model=clone_model(target),
                       draft_model=clone_model(target))
    prompts = random_prompts(LENGTHS)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = make_engine(target).generate(prompts, greedy)
    outs = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    assert engine.speculator.stats.acceptance_rate > 0.5  # int8 copy still mostly agrees


def drafted_tokens(engine) -> list[int]:
    """Every token the engine's draft model proposes from here on (read on the host)."""
    proposer, seen = engine.speculator.proposer, []
    propose = proposer.propose

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        seen.extend(t for d in proposal.token_ids for t in d)
        return proposal

    proposer.propose = recording
    return seen


@pytest.mark.parametrize("served", [False, True])
def test_draft_vocabulary_subset_stays_exact_and_drafts_inside_it(served):
    """served: as the default config runs on the CPU (bf16, int4 target and draft, batch
    invariance on), and each request alone as well as all at once."""
    import torch

    kw = dict(dtype="bfloat16", quantization="int4") if served else {}
    target = build_tiny_model("qwen2", dtype=torch.bfloat16 if served else torch.float32)
    prompts = random_prompts(LENGTHS)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    plain = make_engine(target, **kw)
    expected = [o.output_token_ids for o in plain.generate(prompts, greedy)
                + plain.generate(prompts, seeded)]
    # a copy of the target as the draft: it agrees wherever the subset lets it
    engine = make_engine(target, "draft_model", target, draft_vocab_size=100,
                         draft_quantization="int4" if served else "none", **kw)
    seen = drafted_tokens(engine)
    outs = engine.generate(prompts, greedy) + engine.generate(prompts, seeded)
    assert [o.output_token_ids for o in outs] == expected
    if served:
        alone = [engine.generate([p], sp)[0].output_token_ids
                 for sp, p in [(greedy, p) for p in prompts] + list(zip(seeded, prompts))]
        assert alone == expected
    assert engine.speculator.proposer.runner.shape.vocab_size == 128  # 100 rounded up to 64s
    assert seen and max(seen) < 128  # no tokenizer: the 128 lowest ids
    emitted = [t for ids in expected for t in ids]
    assert any(t >= 128 for t in emitted)  # the target emits what the draft cannot draft
    assert 0.05 < engine.speculator.stats.acceptance_rate < 0.9  # a full copy: > 0.95


def test_draft_vocabulary_subset_keeps_the_target_distribution():
    target, draft, prompt = distribution_pair()
    n = 2400
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(2 * n)]
    plain = third_tokens(make_engine(target), prompt, params[:n])
    engine = make_engine(target, "draft_model", draft, k_max=3, verification="rejection",
                         draft_vocab_size=192)
    seen = drafted_tokens(engine)
    spec = third_tokens(engine, prompt, params[n:])
    assert max(seen) < 192 and (spec >= 192).mean() > 0.1  # q = 0 for a tenth of the outputs
    assert 0.05 < engine.speculator.stats.acceptance_rate < 0.99
    assert same_distribution_pvalue(plain, spec) > 0.001


def test_draft_vocabulary_ranks_added_tokens_first():
    from types import SimpleNamespace

    from engine.models.draft import draft_vocabulary

    tokenizer = SimpleNamespace(added_tokens_decoder={1: "<eos>", 300: "<tool_call>",
                                                      999: "<pad beyond the vocabulary>"})
    ids = draft_vocabulary(tokenizer, 60, 320)
    assert ids.tolist() == list(range(63)) + [300]  # rounded up to 64, ascending
    assert draft_vocabulary(tokenizer, 0, 320) is None
    assert draft_vocabulary(tokenizer, 320, 320) is None
    assert draft_vocabulary(None, 64, 320).tolist() == list(range(64))


def test_greedy_and_sampled_requests_share_a_draft_batch():
    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", seed=1)
    prompts = random_prompts(LENGTHS)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    outs = staggered(make_engine(target, "draft_model", draft), prompts, params)
    plain = staggered(make_engine(target), prompts, params)
    for i, (a, b) in enumerate(zip(outs, plain)):
        assert len(a.output_token_ids) == 16
        if i % 2:
            assert a.output_token_ids == b.output_token_ids


def test_request_can_opt_out_of_speculation():
    target = build_tiny_model("qwen2")
    engine = make_engine(target, "draft_model", target)
    prompts = random_prompts([10, 12])
    outs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                     SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    speculative=False)])
    assert outs[0].num_drafted_tokens > 0 and outs[1].num_drafted_tokens == 0


def test_adaptive_engine_calibrates_and_stays_exact():
    target = build_tiny_model("qwen2")
    engine = make_engine(target, "draft_model", target, adaptive=True)
    assert not engine.speculator.guard.controller.target_cost.empty
    assert not engine.speculator.guard.controller.draft_cost.empty
    prompts = random_prompts(LENGTHS)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = engine.generate(prompts, greedy)
    plain = make_engine(target).generate(prompts, greedy)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    assert engine.speculator.stats.k_chosen_count > 0


# -- adaptive k: the decision alone ----------------------------------------------------------

def controller(target_costs, draft_costs, k_max=6):
    ctl = KController(k_max=k_max)
    for n, s in target_costs.items():
        ctl.target_cost.table.record(n, s)
    for b, s in draft_costs.items():
        ctl.draft_cost.table.record(b, s)
    return ctl


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable()
    for n, s in {1: 1.0, 4: 1.3, 8: 2.0}.items():
        t.record(n, s)
    assert t(1) == 1.0 and t(0.5) == 1.0
    assert t(2) == pytest.approx(1.1)
    assert t(16) == pytest.approx(3.4)
    t.record(1, 2.0)  # EMA moves towards new measurements
    assert 1.0 < t(1) < 2.0


def test_k_is_large_when_verification_is_cheap_and_acceptance_high():
    flat = {n: 0.1 for n in (1, 2, 4, 8, 16, 64)}
    ctl = controller(flat, {1: 0.01, 8: 0.012})
    ks = ctl.choose([0.9, 0.9], other_tokens=0)
    assert min(ks) >= 4


def test_k_is_zero_when_target_is_compute_bound_or_draft_expensive():
    linear = {n: 0.01 * n for n in (1, 2, 4, 8, 16, 64, 256)}
    ctl = controller(linear, {1: 0.001, 64: 0.05})
    assert ctl.choose([0.7] * 64, other_tokens=0) == [0] * 64
    flat = {n: 0.1 for n in (1, 2, 4, 8)}
    expensive_draft = controller(flat, {1: 0.2})
    assert expensive_draft.choose([0.8], other_tokens=0) == [0]


def test_low_acceptance_sequences_get_fewer_drafts():
    costs = {1: 0.1, 2: 0.101, 4: 0.104, 8: 0.11, 16: 0.125, 32: 0.16, 64: 0.24}
    ctl = controller(costs, {1: 0.01, 2: 0.01})
    high, low = ctl.choose([0.95, 0.2], other_tokens=0)
    assert high > low


def test_a_long_draft_backlog_is_not_worth_catching_up():
    flat = {1: 0.1, 2: 0.1, 4: 0.102, 8: 0.105, 16: 0.11, 64: 0.15}
    draft = {1: 0.01, 2: 0.011, 8: 0.015, 64: 0.05, 1024: 0.8, 4096: 3.2}
    ctl = controller(flat, draft)
    fresh, behind = ctl.choose([0.9, 0.9], other_tokens=0, backlog=[2, 4000],
                               remaining=[100, 100])
    assert fresh >= 3 and behind == 0
    # the same backlog is worth catching up when the sequence has long to go
    fresh, behind = ctl.choose([0.9, 0.9], other_tokens=0, backlog=[2, 4000],
                               remaining=[100, 100_000])
    assert fresh >= 3 and behind >= 3


def test_catching_up_on_last_steps_tokens_is_a_cost_of_every_step():
    """The draft forward processes the tokens the previous step emitted, every step: charged
    in full, speculation at this batch does not pay; with nothing to catch up, it would."""
    target = {16: 0.30, 32: 0.43, 48: 0.56}
    draft = {16: 0.06, 32: 0.11, 48: 0.16}
    ctl = controller(target, draft)
    ctl.min_gain_per_seq = 0.0  # this is about the catch-up charge, not the batch's margin
    acc = [0.75] * 16
    assert ctl.choose(acc, 0, backlog=[2] * 16, remaining=[1000] * 16) == [0] * 16
    assert sum(ctl.choose(acc, 0, backlog=[1] * 16, remaining=[1000] * 16)) > 0


def test_the_margin_over_plain_grows_with_the_batch():
    ctl = KController(k_max=4)
    assert ctl.margin(1) == pytest.approx(0.03)
    assert ctl.margin(8) == pytest.approx(0.10)
    assert ctl.margin(64) == pytest.approx(0.12)
    # a 7% predicted win speculates for one sequence, not for eight
    one = controller({1: 0.1, 2: 0.1, 3: 0.1, 8: 0.1, 16: 0.1, 24: 0.1, 32: 0.1}, {1: 0.001,
                                                                                 8: 0.001})
    assert sum(one.choose([0.07], 0)) > 0
    assert sum(one.choose([0.07] * 8, 0)) == 0


def test_a_prompt_backlog_is_caught_up_only_for_a_clear_win():
    """Speculation that wins by a few percent once caught up keeps going for caught-up
    sequences, but is not worth investing a prompt's catch-up in."""
    flat = {1: 0.2, 2: 0.2, 3: 0.2, 8: 0.2}
    draft = {1: 0.05, 2: 0.05, 500: 1.0}
    ctl = controller(flat, draft)
    assert ctl.choose([0.3], 0, backlog=[1], remaining=[10_000]) == [1]  # +4 %
    assert ctl.choose([0.3], 0, backlog=[500], remaining=[10_000]) == [0]
    assert ctl.choose([0.9], 0, backlog=[500], remaining=[10_000])[0] >= 3  # a clear win


def test_realized_acceptance_scales_predicted_gains():
    flat = {1: 0.2, 2: 0.2, 4: 0.2, 8: 0.2}
    ctl = controller(flat, {1: 0.05, 2: 0.05})
    assert ctl.choose([0.5], 0) == [1]
    for _ in range(40):  # the model predicted 0.5 accepted per draft, verification gave 0.2
        ctl.record_verification(1, int(_ % 5 == 0), predicted_accepted=0.5)
    assert ctl.gain_scale == pytest.approx(0.5, abs=0.1)
    assert ctl.choose([0.5], 0) == [0]
    assert ctl.prior_acceptance < 0.5  # new sequences start from what verification showed
    # steps without drafts decay that evidence: it cannot keep speculation off forever
    for _ in range(300):
        if ctl.choose([0.5], 0) == [1]:
            break
        ctl.decay_evidence()  # what the speculator does after a choice without drafts
    assert ctl.choose([0.5], 0) == [1]


def test_per_sequence_cost_is_kept_out_of_the_token_table():
    """16 one-token sequences cost more than one 16-token sequence; the table keeps tokens."""
    ctl = controller({1: 0.1, 16: 0.2, 32: 0.3}, {1: 0.01})
    ctl.target_cost.per_seq = 0.005
    ctl.target_cost.record(16, 16, 0.2 + 15 * 0.005)
    assert ctl.target_cost.table(16) == pytest.approx(0.2)
    assert ctl.target_cost(16, 16) == pytest.approx(0.275)
    assert ctl.target_cost(32, 16) == pytest.approx(0.375)  # drafts add tokens, not sequences


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_fixed_k_when_not_adaptive():
    assert KController(k_max=3, adaptive=False).choose([0.1, 0.9], 0) == [3, 3]


# -- n-gram ----------------------------------------------------------------------------------

def test_ngram_lookup_prefers_longest_most_recent_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    assert ngram_lookup(tokens, 3, 1, 3) == [5, 6, 7]  # "2 3" most recently followed by 5
    assert ngram_lookup([1, 2, 3], 3, 1, 3) == []
    assert ngram_lookup([4, 4, 4, 4], 2, 1, 3) == [4]  # only what follows is available


# -- bad configuration ---------------------------------------------------------------------

def test_k_max_outside_range_is_a_config_error():
    with pytest.raises(ValueError, match="k_max"):
        SpeculativeConfig(method="ngram", k_max=17)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative={"k_maxx": 2})
    with pytest.raises(ValueError, match="draft_stop_confidence"):
        SpeculativeConfig(method="ngram", draft_stop_confidence=1.0)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig(method="ngram", draft_vocab_size=-64)


def test_draft_with_different_vocabulary_is_refused():
    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", vocab_size=400)
    with pytest.raises(ValueError, match="400.*320"):
        make_engine(target, "draft_model", draft)


def test_padding_only_vocabulary_difference_is_allowed(tiny_tokenizer):
    target = build_tiny_model("qwen2", vocab_size=336)
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(330)
    cfg = EngineConfig(num_blocks=64, speculative=SpeculativeConfig(
        method="draft_model", draft_model="in-memory", k_max=3, adaptive=False))
    engine = LLMEngine(cfg, model=clone_model(target), tokenizer=tiny_tokenizer,
                       draft_model=draft)
    outs = engine.generate(random_prompts([9], vocab_size=320),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    plain = make_engine(target).generate(random_prompts([9], vocab_size=320),
                                         SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
    assert outs[0].output_token_ids == plain[0].output_token_ids


def test_realized_rates_turn_speculation_off_where_it_measured_slower():
    from engine.spec_decode.adaptive import RealizedRates

    r = RealizedRates()
    # no plain rate yet: one step in 4 plain, for the class's first 32 decisions
    asked = [r.decide(8) for _ in range(40)]
    assert asked[:32] == (["speculate"] * 3 + ["plain"]) * 8
    assert asked[32:] == ["speculate"] * 8  # then one in 32 (the 64th)
    for _ in range(12):
        r.record(8, True, 16, 1.0)  # 16 tokens/s speculating
        r.record(8, False, 20, 1.0)  # 20 tokens/s plain
        r.record(1, True, 3, 1.0)  # one sequence: speculation wins
        r.record(1, False, 1, 1.0)
    # 9 sequences (the class of 8): plain, with bursts of 3 exploring steps at the end of
    # periods of 16, 32, 64 decisions while the bursts' steps find speculation still slower
    eight = []
    for _ in range(16 + 32 + 64):
        eight.append(r.decide(9))
        if eight[-1] == "explore":
            r.record(9, True, 12, 1.0)
    explored = [i for i, m in enumerate(eight) if m == "explore"]
    assert explored == [13, 14, 15, 45, 46, 47, 109, 110, 111]
    assert eight.count("speculate") == 0
    # a burst that ran no speculative step (nothing worth drafting) does not lengthen the period
    quiet = RealizedRates()
    for _ in range(12):
        quiet.record(2, True, 1, 1.0)
        quiet.record(2, False, 2, 1.0)
    explored = [i for i in range(64) if quiet.decide(2) == "explore"]
    assert explored == [13, 14, 15, 29, 30, 31, 45, 46, 47, 61, 62, 63]
    one = [r.decide(1) for _ in range(32)]
    assert one.count("speculate") == 31  # one plain step to keep the plain rate current
    # speculation got faster: an exploring burst brings it back
    while r.decide(8) != "explore":
        pass
    for _ in range(3):
        r.record(8, True, 30, 1.0)
        r.decide(8)
    assert r.rate(8, True) > r.rate(8, False)
    assert [r.decide(8) for _ in range(8)].count("speculate") >= 7  # (a refresh may fall here)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_without_adaptive_k_the_realized_rates_change_nothing(method):
    """adaptive: false drafts k_max every step, whatever speculation realized or a catch-up
    costs (nothing that depends on timing may change the drafts: rejection-verified output
    must be reproducible)."""
    from engine.spec_decode.adaptive import CostTable

    target = build_tiny_model("qwen2")
    prompts = repetitive_prompts()[:2]
    engine = make_engine(target, method, target if method == "draft_model" else None, k_max=3)
    for _ in range(16):  # speculation "measured" far slower than plain
        engine.speculator.guard.realized.record(1, True, 1, 1.0)
        engine.speculator.guard.realized.record(1, False, 100, 1.0)
    table = engine.speculator.guard.controller.draft_cost.table = CostTable(alpha=0.0)
    table.record(1, 1e-3)
    table.record(64, 10.0)  # a prompt's catch-up "costs" seconds
    for p in prompts:
        engine.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = engine.speculator.stats
    assert stats.num_drafts > 0 and stats.k_chosen_sum / stats.k_chosen_count > 2.5


def test_a_realized_rate_weighs_each_step_by_its_time():
    """Nine quick speculative steps and one that took 20 times as long: the rate is tokens
    over seconds (3.4 tokens/s), not a mean of per-step rates (~9)."""
    from engine.spec_decode.adaptive import RealizedRates

    r = RealizedRates(decay=1.0, min_spec_steps=10)
    for _ in range(9):
        r.record(1, True, 1, 0.1)
    r.record(1, True, 1, 2.0)
    assert r.rate(1, True) == pytest.approx(10 / 2.9)
    assert r.rate(1, False) is None  # no plain step yet
    for _ in range(3):
        r.record(1, False, 1, 0.1)
    assert r.rate(1, False) is None  # three are too few: one unlucky step must not decide
    assert r.saving(1) is None and r.pays_back(1, 100, 1.0) is None


def test_speculation_backs_off_within_a_few_steps_when_it_falls_below_plain():
    from engine.spec_decode.adaptive import RealizedRates

    r = RealizedRates()
    for _ in range(30):
        r.record(4, True, 12, 0.4)  # 30 tokens/s
        r.record(4, False, 4, 0.2)  # 20 tokens/s
    assert r.decide(4) == "speculate"
    slow = 0
    while r.rate(4, True) >= r.rate(4, False):  # acceptance collapsed: 10 tokens/s
        r.record(4, True, 4, 0.4)
        slow += 1
    assert slow <= 5
    assert [r.decide(4) for _ in range(13)] == ["plain"] * 13


def test_a_catch_up_must_pay_back_over_the_tokens_left():
    from engine.spec_decode.adaptive import RealizedRates

    r = RealizedRates()
    for _ in range(12):
        r.record(1, True, 30, 1.0)
        r.record(1, False, 20, 1.0)
    assert r.saving(1) == pytest.approx(1 / 20 - 1 / 30)
    assert r.pays_back(1, 100, 1.0) is True  # 100 tokens save 1.67 s
    assert r.pays_back(1, 30, 1.0) is False  # 30 save 0.5 s
    for _ in range(20):
        r.record(1, True, 10, 1.0)
    assert r.saving(1) < 0 and r.pays_back(1, 10_000, 0.01) is False


@pytest.mark.parametrize("realized_spec_rate, drafts", [(10.01, False), (1000.0, True)])
def test_a_prompt_is_caught_up_only_where_realized_speculation_pays_it_back(realized_spec_rate,
                                                                            drafts):
    """The plan (cost tables) predicts a big win; what speculation realized at this batch size
    decides whether the draft model catches up on a 60-token prompt: 200 tokens at a saving of
    0.1 ms each do not pay for the catch-up's ~1 s, at 99 ms each they do. Output is plain's."""
    from engine.spec_decode.adaptive import CostTable

    target = build_tiny_model("qwen2")
    prompt = random_prompts([60], seed=3)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    plain = make_engine(target).generate(prompt, params)
    engine = make_engine(target, "draft_model", target, adaptive=True)
    spec = engine.speculator.guard
    spec.realized.decay = 1.0  # these rates outweigh what the run itself measures
    for _ in range(spec.realized.min_spec_steps):
        spec.realized.record(1, True, int(realized_spec_rate * 1e6), 1e6)
        spec.realized.record(1, False, 10_000_000, 1e6)
    spec.controller.draft_cost.table = CostTable()
    for size in (1, 2, 4, 8):  # steady drafting looks free...
        spec.controller.draft_cost.table.record(size, size * 1e-6)
    spec.controller.draft_cost.table.record(64, 1.0)  # ... a 60-token catch-up costs ~1 s
    out = engine.generate(prompt, params)
    assert out[0].output_token_ids == plain[0].output_token_ids
    assert (spec.stats.num_draft_tokens > 0) == drafts
