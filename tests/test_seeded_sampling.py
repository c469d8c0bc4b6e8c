"""Seeded sampling does not depend on speculation: position-keyed noise, coupled verification.

A seeded request's tokens are a function of (seed, prompt, sampling settings) alone: the same
with speculation off, with a draft model or n-gram drafts, at any k, alone or in a batch.
"""

import pytest
import torch

from conftest import (build_tiny_model, clone_model, distribution_pair, random_prompts,
                      same_distribution_pvalue, third_tokens)
from conftest import make_engine as shared_engine
from engine import SamplingParams
from engine.sample import keys, sampler

SETTINGS = {
    "t1": dict(temperature=1.0),
    "t07_top_p": dict(temperature=0.7, top_p=0.9),
    "t08_top_k_rep": dict(temperature=0.8, top_k=20, repetition_penalty=1.2),
}
SEEDS = range(20)
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def pair():
    """A target with spread-out distributions and a draft that agrees with it only partly."""
    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", seed=3, num_layers=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.15)
        draft.lm_head.weight.copy_(target.lm_head.weight * 0.9 + draft.lm_head.weight * 0.02)
    return target, draft


def make_engine(target, method="none", draft=None, k_max=4, verification="coupled",
                max_num_seqs=8, **kw):
    return shared_engine(target, method, draft, k_max, verification=verification,
                         ngram_max_n=3, num_blocks=512, max_num_batched_tokens=256,
                         max_num_seqs=max_num_seqs, **kw)


def seeded_requests(seeds=SEEDS):
    """(prompt, params) for every seed x setting; prompts repeat themselves so that n-gram
    drafts find matches."""
    out = []
    for seed in seeds:
        base = random_prompts([5 + seed % 7], seed=100 + seed)[0]
        for name, setting in SETTINGS.items():
            out.append((base * 3, SamplingParams(max_tokens=MAX_TOKENS, seed=seed,
                                                 ignore_eos=True, **setting)))
    return out


def mixed_batch(requests):
    """The seeded requests interleaved with greedy and unseeded sampled ones (batches of 8)."""
    others = [(random_prompts([9], seed=7)[0], SamplingParams(temperature=0, max_tokens=20,
                                                             ignore_eos=True)),
              (random_prompts([14], seed=8)[0], SamplingParams(temperature=1.0, max_tokens=30,
                                                              ignore_eos=True))]
    out = []
    for i, request in enumerate(requests):
        out.append(request)
        if i % 3 == 2:
            out.append(others[(i // 3) % 2])
    return out


def run(engine, requests):
    outs = engine.generate([p for p, _ in requests], [sp for _, sp in requests])
    return [o.output_token_ids for o, (_, sp) in zip(outs, requests) if sp.seed is not None]


@pytest.fixture(scope="module")
def plain_outputs(pair):
    target, _ = pair
    requests = seeded_requests()
    return [run(make_engine(target, max_num_seqs=1), [r])[0] for r in requests]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("k_max", [1, 4, 8])
def test_seeded_speculation_equals_plain_in_a_mixed_batch(pair, plain_outputs, method, k_max):
    target, draft = pair
    engine = make_engine(target, method, draft if method == "draft_model" else None, k_max)
    assert run(engine, mixed_batch(seeded_requests())) == plain_outputs
    st = engine.speculator.stats
    assert st.num_draft_tokens > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_speculation_equals_plain_alone(pair, plain_outputs, method):
    target, draft = pair
    requests = seeded_requests()
    for k_max in (1, 8):
        engine = make_engine(target, method, draft if method == "draft_model" else None, k_max,
                             max_num_seqs=1)
        picked = list(range(0, len(requests), 7))  # every setting, several seeds
        assert [run(engine, [requests[i]])[0] for i in picked] == \
            [plain_outputs[i] for i in picked]


@pytest.mark.parametrize("tables", ["cheap_draft", "costly_target_steps"])
def test_seeded_speculation_equals_plain_under_adaptive_k(pair, plain_outputs, tables):
    """Adaptive k from forced cost tables: k changes from step to step, the tokens do not."""
    target, draft = pair
    engine = make_engine(target, "draft_model", draft, k_max=6)
    engine.speculator.config.adaptive = engine.speculator.guard.controller.adaptive = True
    ctl = engine.speculator.guard.controller
    target_costs = ({1: 0.01, 8: 0.011, 64: 0.02} if tables == "cheap_draft"
                    else {1: 0.01, 4: 0.02, 16: 0.08, 64: 0.3})
    draft_costs = {1: 0.0005, 64: 0.001} if tables == "cheap_draft" else {1: 0.003, 64: 0.05}
    for n, s in target_costs.items():
        ctl.target_cost.table.record(n, s)
    for n, s in draft_costs.items():
        ctl.draft_cost.table.record(n, s)
    ctl.target_cost.table.alpha = ctl.draft_cost.table.alpha = 0.0  # keep them forced
    assert run(engine, mixed_batch(seeded_requests())) == plain_outputs
    st = engine.speculator.stats
    assert st.num_draft_tokens > 0
    ks_seen = st.k_chosen_sum / max(st.k_chosen_count, 1)
    assert 0 < ks_seen < 6  # k really varied between sequences and steps


def test_rejection_verification_is_a_switch(pair, plain_outputs):
    """`verification: rejection` verifies seeded requests by rejection sampling: still
    reproducible run to run, but the tokens depend on the drafts."""
    target, draft = pair
    requests = seeded_requests(range(6))
    outs = [run(make_engine(target, "draft_model", draft, 4, verification="rejection"),
                requests) for _ in range(2)]
    assert outs[0] == outs[1]
    assert outs[0] != plain_outputs[:len(requests)]


def test_noise_of_a_position_does_not_depend_on_earlier_drafts(pair, monkeypatch):
    """The noise a seeded row races with at output position t is the draw of
    noise_key(seed, t): the same whether earlier steps verified 0, 1 or 8 drafts."""
    target, draft = pair
    prompt, params = seeded_requests([4])[0]
    vocab = target.config.vocab_size
    seen: dict[int, list[torch.Tensor]] = {}  # key -> noise rows drawn with it
    real = sampler.exponential_noise

    def spy(shape, row_keys, device, default):
        noise = real(shape, row_keys, device, default)
        for row, key in enumerate(row_keys):
            if key is not None:
                seen.setdefault(key, []).append(noise[row].clone())
        return noise

    monkeypatch.setattr(sampler, "exponential_noise", spy)
    for k_max in (1, 8):
        run(make_engine(target, "draft_model", draft, k_max), [(prompt, params)])
    run(make_engine(target), [(prompt, params)])
    for t in range(MAX_TOKENS):
        key = keys.noise_key(params.seed, t)
        expected = -torch.tensor([keys.stream_uniform(key, j) for j in range(vocab)]).log()
        assert key in seen, t
        assert all(torch.equal(row, expected) for row in seen[key]), t


def test_coupled_engine_keeps_the_target_distribution():
    """Seeded rows (coupled) over many seeds, and unseeded rows in the same batches (rejection
    sampling), both have the distribution of plain decoding."""
    target, draft, prompt = distribution_pair()
    n = 2000

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)

    unseeded = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    plain = third_tokens(make_engine(target, max_num_seqs=64), prompt,
                          [params(s) for s in range(n)] + [unseeded] * n)
    engine = make_engine(target, "draft_model", draft, k_max=3, max_num_seqs=64)
    mixed = [p for s in range(n, 2 * n) for p in (params(s), unseeded)]
    spec = third_tokens(engine, prompt, mixed)
    assert 0.05 < engine.speculator.stats.acceptance_rate < 0.99
    assert same_distribution_pvalue(plain[:n], spec[0::2]) > 0.001  # seeded, coupled
    assert same_distribution_pvalue(plain[n:], spec[1::2]) > 0.001  # unseeded, rejection


@pytest.mark.parametrize("method, quantization", [("suffix", "none"), ("hybrid", "none"),
                                                  ("draft_model", "int4")])
def test_seeded_speculation_equals_plain_in_bf16(pair, method, quantization):
    """In the dtype we serve (bf16, batch invariance on): seeded output with suffix or hybrid
    drafts, and on an int4-quantized target with the draft model, in a mixed batch, equals
    the same engine's plain output one request at a time."""
    target, draft = (clone_model(m).to(torch.bfloat16) for m in pair)
    requests = seeded_requests(range(6))
    plain_engine = make_engine(target, max_num_seqs=1, quantization=quantization)
    plain = [run(plain_engine, [r])[0] for r in requests]
    engine = make_engine(target, method, draft if method != "suffix" else None, 4,
                         quantization=quantization)
    assert engine.runner.invariance is not None and engine.runner.invariance.invariant
    if quantization == "int4":
        from engine.kernels.quant_linear import Int4Linear

        assert any(isinstance(m, Int4Linear) for m in engine.runner.model.modules())
    assert run(engine, mixed_batch(requests)) == plain
    st = engine.speculator.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
