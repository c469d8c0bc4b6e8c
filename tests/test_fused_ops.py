"""The fused CPU ops between a layer's matmuls (engine/kernels/fused.py): each row's bits do not
depend on the other rows of the call (1..8 rows, ragged, strided inputs, a prompt-sized call
split over threads), in fp32 and bf16, at both packaged models' shapes; each is within its
stated bound of torch's ops; the lean forward with them keeps speculation exact in the served
form (bf16, int4), greedy and seeded, alone and batched."""

import pytest
import torch

from conftest import build_tiny_model, make_engine, random_prompts
from engine import SamplingParams
from engine.kernels import fused

HAS_FUSED = not isinstance(fused.kernel(), str)
pytestmark = pytest.mark.skipif(not HAS_FUSED, reason="the CPU has no AVX-512 (fused ops)")

# (hidden, intermediate, heads, kv heads, head_dim) of the target and the draft we serve
SHAPES = {"1.5b": (1536, 8960, 12, 2, 128), "0.5b": (896, 4864, 14, 2, 64)}
DTYPES = [torch.float32, torch.bfloat16]
RAGGED = [[0, 1], [1, 3], [3, 4], [4, 8]]  # one call of 8 rows split into calls of 1, 2, 1, 4


def _rows(m, k, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: a row's result must not depend on its neighbours'
    mags = torch.logspace(-2, 2, m)[:, None]
    return (torch.randn(m, k, generator=g) * mags * scale).to(dtype)


def _ulps(a, b, dtype):
    """Largest difference in units of the dtype's last place at b's magnitude."""
    eps = torch.finfo(dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs() * eps).clamp_min(1e-30)).max().item()


def _each_alone_and_ragged(op, *inputs):
    """op on all rows at once; on each row alone; on ragged splits: all the same bits."""
    whole = op(*inputs)
    for i in range(inputs[0].shape[0]):
        assert torch.equal(op(*(t[i:i + 1] for t in inputs)), whole[i:i + 1])
    for a, b in RAGGED:
        assert torch.equal(op(*(t[a:b] for t in inputs)), whole[a:b])
    return whole


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_and_add_are_per_row_and_within_a_rounding(dtype, shape):
    hidden = SHAPES[shape][0]
    ops = fused.kernel()
    x, d = _rows(8, hidden, dtype, 0), _rows(8, hidden, dtype, 1)
    w = (torch.rand(hidden, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    y = _each_alone_and_ragged(lambda a: ops.rms_norm(a, w, 1e-6), x)
    ref = fused.rms_norm_reference(x, w, 1e-6)
    # the mean square summed in another order: at most a rounding of the dtype apart (fp32:
    # a few ulps through the rsqrt, on a whole row; bf16: on few elements)
    assert _ulps(y, ref, dtype) <= (1.0 if dtype == torch.bfloat16 else 8.0)
    if dtype == torch.bfloat16:
        assert (y != ref).float().mean() < 0.05
    h, y2 = ops.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(h, x + d)  # the residual sum rounds as torch's add
    assert torch.equal(y2, ops.rms_norm(x + d, w, 1e-6))
    for i in range(8):
        hi, yi = ops.add_rms_norm(x[i:i + 1], d[i:i + 1], w, 1e-6)
        assert torch.equal(hi, h[i:i + 1]) and torch.equal(yi, y2[i:i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_mul_is_per_row_on_strided_halves_and_within_a_rounding(dtype, shape):
    inter = SHAPES[shape][1]
    ops = fused.kernel()
    merged = _rows(8, 2 * inter, dtype, 3, scale=0.1)  # gate | up, as one projection's rows
    gate, up = merged[:, :inter], merged[:, inter:]
    y = _each_alone_and_ragged(ops.silu_mul, gate, up)
    assert torch.equal(y, ops.silu_mul(gate.contiguous(), up.contiguous()))
    ref = fused.silu_mul_reference(gate, up)
    # our e^-|x| against torch's: the silu may round to the neighbouring value of the dtype
    if dtype == torch.bfloat16:
        assert _ulps(y, ref, dtype) <= 2.0 and (y != ref).float().mean() < 0.01
    else:
        assert torch.allclose(y, ref, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_is_per_row_in_place_and_bit_identical_to_torch(dtype, shape):
    _, _, heads, kv_heads, head_dim = SHAPES[shape]
    ops = fused.kernel()
    width = (heads + 2 * kv_heads) * head_dim
    qkv = _rows(8, width, dtype, 4)
    angles = torch.arange(8)[:, None] * torch.rand(head_dim // 2)[None] * 3
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def rotated(rows, c, s):  # the query part of a merged projection, in place on a copy
        out = rows.clone()
        ops.rotary_(out[:, :heads * head_dim], c, s, head_dim)
        return out

    whole = _each_alone_and_ragged(rotated, qkv, cos, sin)
    q = qkv[:, :heads * head_dim].view(8, heads, head_dim)
    ref = fused.rotary_reference(q, cos[:, None], sin[:, None]).reshape(8, -1)
    assert torch.equal(whole[:, :heads * head_dim], ref)
    assert torch.equal(whole[:, heads * head_dim:], qkv[:, heads * head_dim:])  # k, v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_sized_call_split_over_threads_gives_each_row_its_bits(dtype):
    hidden, inter = SHAPES["0.5b"][:2]
    ops = fused.kernel()
    x = _rows(300, hidden, dtype, 5)
    w = torch.ones(hidden, dtype=dtype)
    g, u = _rows(300, inter, dtype, 6, 0.1), _rows(300, inter, dtype, 7, 0.1)
    norms, acts = ops.rms_norm(x, w, 1e-5), ops.silu_mul(g, u)
    for i in (0, 151, 299):
        assert torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-5), norms[i:i + 1])
        assert torch.equal(ops.silu_mul(g[i:i + 1], u[i:i + 1]), acts[i:i + 1])


def test_bad_inputs_are_refused():
    ops = fused.kernel()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rms_norm(torch.randn(2, 40), torch.ones(40), 1e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.silu_mul(torch.randn(2, 32).half(), torch.randn(2, 32).half())
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.rotary_(torch.randn(2, 48), torch.randn(2, 48), torch.randn(2, 48), 48)


def _head32(dtype):  # head_dim 32: every fused op runs (16 would leave rotary to torch)
    return build_tiny_model("qwen2", dtype=dtype, num_attention_heads=2, num_key_value_heads=1)


def test_lean_forward_with_fused_ops_is_torchs_within_roundings():
    from engine.batch import RunItem
    from engine.model_runner import ModelRunner

    model = _head32(torch.bfloat16)
    runner = ModelRunner(model, num_blocks=16, block_size=16, batch_invariant=True)
    prompt = random_prompts([30])[0]
    item = RunItem(prompt, 0, list(range(4)), 30, None)

    def logits(enabled):
        fused.ENABLED = enabled
        try:
            return runner.execute([item]).logits.float()
        finally:
            fused.ENABLED = True

    a, b = logits(True), logits(False)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_served_form_with_fused_ops_keeps_speculation_exact_alone_and_batched():
    """bf16, int4 target and draft with a vocabulary subset, batch invariance on, every fused
    op running: greedy and seeded output with speculation equals plain decoding's, alone and
    batched."""
    target = _head32(torch.bfloat16)
    kw = dict(dtype="bfloat16", quantization="int4")
    prompts = random_prompts([5, 17, 9, 30, 12, 3])
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    plain = make_engine(target, **kw)
    assert plain.runner.invariance.invariant
    expected = [o.output_token_ids for o in plain.generate(prompts, greedy)
                + plain.generate(prompts, seeded)]
    engine = make_engine(target, "draft_model", target, draft_vocab_size=200,
                         draft_quantization="int4", **kw)
    outs = engine.generate(prompts, greedy) + engine.generate(prompts, seeded)
    assert [o.output_token_ids for o in outs] == expected
    alone = [engine.generate([p], sp)[0].output_token_ids
             for sp, p in [(greedy, p) for p in prompts] + list(zip(seeded, prompts))]
    assert alone == expected
    assert engine.speculator.stats.acceptance_rate > 0.3


def test_without_the_fused_kernel_the_lean_forward_gives_the_models_own_bits(monkeypatch):
    """A CPU without AVX-512 (or no compiler): torch's ops, the transformers model's bits."""
    from engine.batch import RunItem
    from engine.model_runner import ModelRunner

    monkeypatch.setattr(fused, "kernel", lambda: "the CPU lacks avx512f")
    assert not fused.usable(torch.zeros(1, 64))
    runner = ModelRunner(_head32(torch.bfloat16), num_blocks=16, block_size=16,
                         batch_invariant=True)
    item = RunItem(random_prompts([30])[0], 0, list(range(4)), 30, None)
    lean = runner.execute([item]).logits
    runner.lean = False
    assert torch.equal(runner.execute([item]).logits, lean)
