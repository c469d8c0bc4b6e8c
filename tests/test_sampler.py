"""Logits processing and sampling: small tensors, exact expectations."""

import math

import pytest
import torch

from engine.sample import sampler
from engine.sample.keys import noise_key, stream_uniform
from engine.sampling_params import SamplingParams


def rows(*params, prompt=(), output=(), keys=None):
    keys = keys or [None] * len(params)
    return [sampler.RowSpec(p, list(prompt), list(output), k) for p, k in zip(params, keys)]


def process(logits, *params, **kw):
    t = sampler.build_sampling_tensors(rows(*params, **kw), logits.shape[-1], logits.device)
    return sampler.process_logits(logits, t), t


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def allowed(processed):
    return torch.isfinite(processed[0]).nonzero()[:, 0].tolist()


def test_greedy_is_argmax_and_untouched():
    out, t = process(LOGITS, SamplingParams(temperature=0))
    assert t.all_greedy and torch.equal(out, LOGITS)
    assert sampler.sample(out, t).tolist() == [0]


def test_temperature_scales():
    out, _ = process(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(out, LOGITS / 0.5)


def test_top_k_keeps_k_best():
    out, _ = process(LOGITS, SamplingParams(top_k=3))
    assert allowed(out) == [0, 1, 2]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)
    out, _ = process(LOGITS, SamplingParams(top_p=float(probs[0] + probs[1]) - 1e-4))
    assert allowed(out) == [0, 1]
    out, _ = process(LOGITS, SamplingParams(top_p=float(probs[0]) / 2))
    assert allowed(out) == [0]  # the best token always stays


def test_min_p_relative_to_best():
    probs = torch.softmax(LOGITS[0], -1)
    ratio = float(probs[2] / probs[0])
    out, _ = process(LOGITS, SamplingParams(min_p=ratio - 1e-4))
    assert allowed(out) == [0, 1, 2]


def test_logit_bias_and_penalties():
    out, _ = process(LOGITS, SamplingParams(temperature=0, logit_bias={5: 10.0}))
    assert out[0, 5].item() == 7.0
    out, _ = process(LOGITS, SamplingParams(temperature=0, presence_penalty=0.5,
                                            frequency_penalty=0.25), output=[1, 1, 2])
    assert out[0, 1].item() == 1.0 - 0.5 - 0.5
    assert out[0, 2].item() == 0.5 - 0.5 - 0.25
    assert out[0, 0].item() == 2.0
    out, _ = process(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0),
                     prompt=[0], output=[4])
    assert out[0, 0].item() == 1.0 and out[0, 4].item() == -2.0 and out[0, 1].item() == 1.0


def test_rows_have_independent_params():
    logits = LOGITS.repeat(3, 1)
    t = sampler.build_sampling_tensors(
        rows(SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=1.0),
             SamplingParams(top_k=2)), 6, logits.device)
    out = sampler.process_logits(logits, t)
    assert torch.isfinite(out[0]).all()  # greedy row untouched
    assert torch.isfinite(out[2]).sum() == 2


def test_settings_are_built_once_per_batch_composition():
    """A steady batch (the same params objects, row for row) reuses its settings tensors;
    another composition, or equal settings in another request's params, gets its own, and the
    processed logits are the same either way."""
    a = SamplingParams(temperature=0.7, top_k=2, logit_bias={1: 3.0})
    b = SamplingParams(temperature=0)
    logits = LOGITS.repeat(3, 1)
    cache = sampler.SettingsCache()
    first = sampler.build_sampling_tensors(rows(a, a, b), 6, logits.device, cache=cache)
    again = sampler.build_sampling_tensors(rows(a, a, b, output=[1]), 6, logits.device,
                                           cache=cache)
    assert again.temperature is first.temperature and again.top_k is first.top_k
    assert again.logit_bias is first.logit_bias
    twin = SamplingParams(temperature=0.7, top_k=2, logit_bias={1: 3.0})
    other = sampler.build_sampling_tensors(rows(twin, a, b), 6, logits.device, cache=cache)
    shorter = sampler.build_sampling_tensors(rows(a, b), 6, logits.device, cache=cache)
    assert other.temperature is not first.temperature
    assert shorter.temperature.shape == (2,) and shorter.greedy_rows == [False, True]
    assert torch.equal(sampler.process_logits(logits, other),
                       sampler.process_logits(logits, first))
    for _ in range(cache.size + 1):  # bounded: old compositions go
        sampler.build_sampling_tensors(rows(SamplingParams()), 6, logits.device, cache=cache)
    assert len(cache.entries) <= cache.size
    assert sampler.build_sampling_tensors(rows(a, a, b), 6, logits.device,
                                          cache=cache).temperature is not first.temperature
    assert sampler.build_sampling_tensors(rows(a, a, b), 6, logits.device).temperature \
        is not sampler.build_sampling_tensors(rows(a, a, b), 6, logits.device).temperature


def test_seeded_rows_reproducible_regardless_of_batch():
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=3)

    def draw(batch_size):
        specs = rows(*([SamplingParams(temperature=1.0)] * (batch_size - 1) + [p]),
                     keys=[None] * (batch_size - 1) + [noise_key(3, 0)])
        t = sampler.build_sampling_tensors(specs, 50, logits.device)
        big = logits.repeat(batch_size, 1)
        return [sampler.sample(sampler.process_logits(big, t), t)[-1].item() for _ in range(1)]

    assert draw(1) == draw(5) == draw(9)


def test_keyed_uniforms_are_the_keys_streams():
    """All rows in one call, each the stream `keys.stream_uniform` defines, for keys across
    [0, 2^63) (int64 arithmetic must wrap exactly as the 64-bit definition)."""
    keys = [0, 1, noise_key(3, 0), noise_key(2**40, 7, 2), (1 << 63) - 1]
    u = sampler.keyed_uniforms(keys, 5000, torch.device("cpu"))
    assert u.shape == (5, 5000) and u.dtype == torch.float32
    for r, key in enumerate(keys):
        for j in (0, 1, 2, 999, 4999):
            assert u[r, j].item() == stream_uniform(key, j), (key, j)
    alone = sampler.keyed_uniforms(keys[2:3], 5000, torch.device("cpu"))
    assert torch.equal(alone[0], u[2])  # a row's draws do not depend on the other rows


@pytest.mark.parametrize("n", [1, 7, 8, 9, 5003, 151_936])
def test_keyed_uniforms_of_the_cpu_kernel_are_the_torch_ops_bits(monkeypatch, n):
    """The C++ loop (csrc/fused_ops.cpp) and the torch ops compute the same bits: every
    column (the vector body and the scalar tail), every row of a batch the kernel splits
    across threads."""
    from engine.kernels import fused
    if isinstance(fused.kernel(), str):
        pytest.skip(f"no fused CPU kernels: {fused.kernel()}")
    keys = [0, 1, (1 << 63) - 1] + [noise_key(s, p, 2) for s in range(5) for p in range(7)]
    kernel = sampler.keyed_uniforms(keys, n, torch.device("cpu"))
    monkeypatch.setattr(fused, "ENABLED", False)
    ops = sampler.keyed_uniforms(keys, n, torch.device("cpu"))
    assert kernel.shape == ops.shape == (len(keys), n)
    assert torch.equal(kernel, ops)
    assert kernel[:, -1].tolist() == [stream_uniform(k, n - 1) for k in keys]


def test_keyed_noise_is_uniform_then_exponential():
    """The streams are U(0, 1) (Kolmogorov-Smirnov) and a keyed row's noise is Exp(1):
    -log of them, the same draws whether the batch has unkeyed rows or not."""
    n = 200_000
    u = sampler.keyed_uniforms([noise_key(11, 5)], n, torch.device("cpu"))[0].double()
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max()
    assert ks < 1.63 / math.sqrt(n)  # 1% level
    assert 0 < u.min() and u.max() < 1
    key = noise_key(11, 6)
    mixed = sampler.exponential_noise((3, 1000), [None, key, None], torch.device("cpu"),
                                      torch.Generator().manual_seed(0))
    alone = sampler.exponential_noise((1, 1000), [key], torch.device("cpu"), None)
    assert torch.equal(mixed[1], alone[0])
    assert torch.equal(alone[0], -sampler.keyed_uniforms([key], 1000, torch.device("cpu"))[0]
                       .log())
    assert abs(mixed[[0, 2]].mean().item() - 1) < 0.1


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits[0], -1)
    n = 40000
    t = sampler.build_sampling_tensors(rows(*[SamplingParams(temperature=1.0)] * n), 4,
                                       logits.device)
    gen = torch.Generator().manual_seed(0)
    ids = sampler.sample(sampler.process_logits(logits.repeat(n, 1), t), t, gen)
    freq = torch.bincount(ids, minlength=4).float() / n
    # 4 standard errors of a binomial proportion
    assert torch.all((freq - probs).abs() < 4 * torch.sqrt(probs * (1 - probs) / n))


def test_logprobs_are_raw_model_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    chosen, vals, ids = sampler.logprob_tensors(logits, torch.tensor([1, 2]), 2)
    res = sampler.logprob_entries(chosen.tolist(), vals.tolist(), ids.tolist(), [2, 1])
    chosen, top = res[0]
    assert math.isclose(chosen, torch.log_softmax(logits[0], -1)[1].item(), abs_tol=1e-6)
    assert [tok for tok, _ in top] == [0, 1]
    assert math.isclose(top[0][1], torch.log_softmax(logits[0], -1)[0].item(), abs_tol=1e-6)
    assert len(res[1][1]) == 1 and math.isclose(res[1][0], -math.log(3), abs_tol=1e-6)


def test_the_cuda_kernel_of_keyed_uniforms_has_the_torch_path_s_bits():
    """kernels/keyed_noise.py (what CUDA runs), here through Triton's interpreter."""
    from engine.kernels import keyed_noise

    if not keyed_noise.available():
        pytest.skip("triton is not installed")
    keys = [0, 5, noise_key(3, 0), noise_key(2**40, 7, 2), (1 << 63) - 1]
    got = keyed_noise.keyed_uniforms(torch.tensor(keys), 2500)
    assert torch.equal(got, sampler.keyed_uniforms(keys, 2500, torch.device("cpu")))
