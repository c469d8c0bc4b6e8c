"""LLMEngine end to end on tiny random models."""

import pytest
import torch

from conftest import build_tiny_model, clone_model, make_engine, random_prompts, staggered
from engine import EngineConfig, LLMEngine, SamplingParams

LENGTHS = [3, 50, 17, 90, 8, 33, 1, 64]


def engine_for(model, **kw):
    return make_engine(model, **{"num_blocks": 128, "max_num_batched_tokens": 64, **kw})


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_staggered_concurrent_equals_hf_generate(arch):
    model = build_tiny_model(arch)
    engine = engine_for(model)
    prompts = random_prompts(LENGTHS)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    outs = staggered(engine, prompts, params)
    for p, o in zip(prompts, outs):
        assert o.output_token_ids == hf_greedy(model, p, 24)
        assert o.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_same_alone_or_in_batch():
    model = build_tiny_model("qwen2")
    prompts = random_prompts(LENGTHS, seed=5)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234,
                            ignore_eos=True)
    alone = engine_for(model).generate([prompts[3]], seeded)[0].output_token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(7)]
    params = others[:3] + [seeded] + others[3:]
    batch = staggered(engine_for(model, seed=99), prompts, params, arrive_every=1)
    assert batch[3].output_token_ids == alone
    # and the batch really sampled: different seeds gave different continuations
    assert len({tuple(o.output_token_ids) for o in batch}) > 1


def test_unseeded_sampling_follows_engine_seed():
    model = build_tiny_model("qwen2")
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = engine_for(model, seed=7).generate(random_prompts([5, 9]), p)
    b = engine_for(model, seed=7).generate(random_prompts([5, 9]), p)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


def test_prefix_cache_reuses_shared_64_token_prefix():
    model = build_tiny_model("qwen2")
    prefix = random_prompts([64], seed=11)[0]
    first = prefix + random_prompts([7], seed=12)[0]
    second = prefix + random_prompts([9], seed=13)[0]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = engine_for(model, block_size=16)
    engine.generate([first], greedy)
    hits_before = engine.block_manager.prefix_stats.hits
    out = engine.generate([second], greedy)[0]
    assert out.num_cached_tokens == 64
    assert engine.block_manager.prefix_stats.hits - hits_before == 64
    cold = engine_for(model, enable_prefix_caching=False).generate([second], greedy)[0]
    assert out.output_token_ids == cold.output_token_ids == hf_greedy(model, second, 10)


def test_out_of_blocks_all_complete_identically_with_preemptions():
    model = build_tiny_model("qwen2")
    prompts = random_prompts([10 + 7 * i for i in range(16)], seed=21)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = engine_for(model, num_blocks=512, max_num_seqs=16).generate(prompts, greedy)
    small_engine = engine_for(model, num_blocks=24, block_size=8, max_num_seqs=16,
                              max_num_batched_tokens=128)
    small = small_engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in small] == [o.output_token_ids for o in big]
    assert all(len(o.output_token_ids) == 40 for o in small)
    assert small_engine.scheduler.stats.num_preemptions > 0
    assert small_engine.block_manager.num_free_blocks == 24


def test_logprobs_of_chosen_tokens():
    model = build_tiny_model("qwen2")
    engine = engine_for(model)
    prompt = random_prompts([12])[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=5,
                                                   ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(expected[out.output_token_ids[0]].item(), abs=1e-4)
    assert [t for t, _ in top] == expected.topk(5).indices.tolist()
    assert top[0][0] == out.output_token_ids[0]  # greedy picks the top token


def test_eos_and_stop_token_ids_stop_generation():
    model = build_tiny_model("qwen2")
    engine = engine_for(model)
    prompt = random_prompts([6])[0]
    free_run = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))[0].output_token_ids
    stop_at = free_run[3]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                   stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.output_token_ids == free_run[:free_run.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    # the model's eos (id 1 in the tiny config) stops unless ignore_eos
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={1: 100.0})
    out = engine.generate([prompt], biased)[0]
    assert out.output_token_ids == [1] and out.finish_reason == "stop"


def test_context_length_is_a_stop_condition():
    model = build_tiny_model("qwen2")
    engine = engine_for(model, max_model_len=40)
    out = engine.generate([random_prompts([35])[0]],
                          SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 500.0}), "logit_bias"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_rejected_before_scheduling_and_others_unaffected():
    model = build_tiny_model("qwen2")
    engine = engine_for(model, max_model_len=64)
    good = random_prompts([10])[0]
    rid = engine.add_request(good, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(random_prompts([64])[0])  # no room for a new token
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([10**6])
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(good, SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(good, request_id=rid)
    assert engine.num_waiting == 0 and engine.num_running == 1
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final.output_token_ids == hf_greedy(model, good, 6)


def test_abort_frees_blocks_within_a_step():
    model = build_tiny_model("qwen2")
    engine = engine_for(model)
    rid = engine.add_request(random_prompts([30])[0], SamplingParams(max_tokens=100))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


def test_text_prompts_with_tokenizer(tiny_tokenizer):
    model = build_tiny_model("qwen2", vocab_size=len(tiny_tokenizer))
    engine = LLMEngine(EngineConfig(num_blocks=64), model=clone_model(model),
                       tokenizer=tiny_tokenizer)
    out = engine.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=5,
                                                                  ignore_eos=True))[0]
    ids = tiny_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.text == tiny_tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


def _fail_on_step(engine, n, corrupt=False):
    """Make the engine's n-th step raise inside the target forward (a test hook); with
    `corrupt`, it also leaves a block ref count wrong first."""
    execute, calls = engine.runner.execute, [0]

    def failing(*args, **kw):
        calls[0] += 1
        if calls[0] == n:
            if corrupt:
                engine.block_manager.blocks[0].ref_count += 1
            raise RuntimeError("injected failure")
        return execute(*args, **kw)

    engine.runner.execute = failing


@pytest.mark.parametrize("spec", [False, True])
def test_failed_step_aborts_its_requests_and_the_rest_go_on(spec):
    from engine import StepError

    model = build_tiny_model("qwen2")
    extra = dict(speculative=dict(method="suffix", k_max=3, adaptive=False,
                                  calibrate=False)) if spec else {}
    prompts = [p * 3 for p in random_prompts([6, 7, 4, 5], seed=3)]  # repeats to draft from
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = engine_for(model, max_num_seqs=2, **extra).generate(prompts, params)
    engine = engine_for(model, max_num_seqs=2, **extra)
    ids = [engine.add_request(p, params) for p in prompts]
    _fail_on_step(engine, 3)
    final, failed = {}, None
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            outs = engine.step()
        except StepError as exc:
            assert failed is None and exc.intact
            assert isinstance(exc.__cause__, RuntimeError)
            failed = exc.request_ids
            continue
        final.update({o.request_id: o for o in outs if o.finished})
    assert failed == ids[:2]  # the two running ones; the waiting ones were not touched
    for rid, ref in zip(ids[2:], clean[2:]):
        assert final[rid].output_token_ids == ref.output_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_failed_step_with_broken_state_says_so():
    from engine import StepError

    engine = engine_for(build_tiny_model("qwen2"))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    _fail_on_step(engine, 1, corrupt=True)
    with pytest.raises(StepError) as info:
        engine.step()
    assert not info.value.intact
