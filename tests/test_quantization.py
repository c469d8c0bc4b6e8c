"""Weight-only quantized linears: GGUF 4-bit blocks kept exactly, int4/int8 kernels, an engine
serving a quantized target (and draft) exactly: greedy with speculation == greedy without."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model, clone_model, random_prompts, staggered

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig
from engine.kernels.batch_invariant import invariant_row_range
from engine.kernels import quant_linear
from engine.kernels.quant_linear import (Int4Linear, Int8Linear, pack_nibbles, pack_vnni,
                                         quantize_int4_rtn, quantize_int8_rtn, unpack_nibbles,
                                         unpack_vnni)
from engine.models import quantize

HAS_VNNI = not isinstance(quant_linear.vnni_kernel(), str)
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="the CPU has no AVX-512 VNNI")
KERNELS = ["torch", pytest.param("vnni", marks=needs_vnni)]


def _dequantized(codes, scale, offset):
    n, k = codes.shape
    return (codes.double().view(n, -1, 32) * scale.double()[..., None]
            + offset.double()[..., None]).view(n, k)


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (24, 96), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (24, 48) and torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_computes_its_dequantized_weight(dtype):
    """torch's kernel: the activations as they are, the weight within a few roundings."""
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    codes, scale, offset = quantize_int4_rtn(w)
    ref_w = _dequantized(codes, scale, offset)
    step = scale.max().item()
    assert (ref_w - w.double()).abs().max() <= 0.5 * step + 1e-6  # round to nearest
    bias = torch.randn(96)
    layer = Int4Linear(codes, scale, offset, bias, dtype, "cpu", kernel="torch")
    x = torch.randn(7, 256).to(dtype)
    ref = x.double() @ ref_w.t() + bias.to(dtype).double()
    got = layer(x[None])[0]
    assert got.dtype == dtype and got.shape == (7, 96)
    tol = 1e-4 if dtype == torch.float32 else 0.02 * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= tol
    # the weight the layer uses (scale and zero and the de-quantized weight rounded to the
    # dtype) is off by a few roundings: a small fraction of a quantization step
    err = (layer.dequantized().double() - ref_w).abs()
    assert (err <= scale.double().repeat_interleave(32, 1) / 12).all()


def test_vnni_packing_round_trip():
    """The plain form (scales anywhere): fp16 scales and offsets, as packed."""
    torch.manual_seed(3)
    codes = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    scale, offset = torch.rand(48, 3), -torch.rand(48, 3)
    packed, groups, units = pack_vnni(codes, scale, offset)
    assert packed.shape == (3, 3, 256) and groups.shape == (3, 3, 32) and not units.numel()
    assert groups.dtype == torch.float16
    back, sc2, off2 = unpack_vnni(packed, groups, units)
    assert torch.equal(back, codes)
    assert torch.equal(sc2, scale.half().float()) and torch.equal(off2, offset.half().float())
    _, scale, offset = quantize_int4_rtn(torch.randn(48, 96))  # on the compact form's grid,
    scale[5, 1] = float("nan")  # but for one value, a multiple of nothing: the plain form
    packed, groups, units = pack_vnni(codes, scale, offset)
    assert groups.dtype == torch.float16 and not units.numel()
    assert unpack_vnni(packed, groups, units)[1][5, 1].isnan()


def _q4_k_scales(gen, rows, groups, top=63):
    """Q4_K's scales and offsets: per super-block of 8 groups d and dmin (fp16), 6-bit sub-scales
    and mins with the largest `top` in the first row and 63 in the others (llama.cpp's
    quantizer: 63)."""
    runs = -(-groups // 8)
    d = (torch.rand(rows, runs, 1, generator=gen) * 1e-3).half().float()
    dmin = (torch.rand(rows, runs, 1, generator=gen) * 1e-2).half().float()
    tops = torch.full((rows, runs, 1), 63)
    tops[0] = top
    sc = (torch.rand(rows, runs, 8, generator=gen) * (tops + 1)).long()
    mn = (torch.rand(rows, runs, 8, generator=gen) * (tops + 1)).long()
    sc[..., 0], mn[..., 3] = tops[..., 0], tops[..., 0]
    return ((d * sc).reshape(rows, -1)[:, :groups].contiguous(),
            (-(dmin * mn)).reshape(rows, -1)[:, :groups].contiguous())


@pytest.mark.parametrize("top", [63, 41])
def test_vnni_compact_form_keeps_q4_k_and_round_to_nearest_scales_exactly(top):
    """Q4_K's scales (d * sc, -dmin * m) and our round-to-nearest ones pack as 8-bit multiples
    of fp16 units per 8 groups and unpack to the very fp32 values; also for a share of the
    input features that ends within a run (a tensor-parallel split of 8960 columns), and where
    a few super-blocks' largest code is not 63."""
    gen = torch.Generator().manual_seed(4)
    for groups in (16, 140):
        rows = 128 if groups == 16 else 32  # (at most 1% of the runs off 63: 1 row of 128)
        codes = torch.randint(0, 16, (rows, 32 * groups), dtype=torch.uint8, generator=gen)
        for scale, offset in (_q4_k_scales(gen, rows, groups, top if rows == 128 else 63),
                              quantize_int4_rtn(torch.randn(rows, 32 * groups, generator=gen))[1:]):
            packed, multiples, units = pack_vnni(codes, scale, offset)
            assert multiples.dtype == torch.uint8 and multiples.shape == (rows // 16, groups, 32)
            assert units.dtype == torch.float16
            assert units.shape == (rows // 16, -(-groups // 8), 32)
            back, sc2, off2 = unpack_vnni(packed, multiples, units)
            assert torch.equal(back, codes)
            assert torch.equal(sc2, scale) and torch.equal(off2, offset)
    # 36 bytes of scales per 256 of codes, against the plain form's 64
    assert (multiples.numel() + 2 * units.numel()) / packed.numel() == (140 * 32 + 18 * 64) / (
        140 * 256)
    # scales of every super-block off 63 (not llama.cpp's quantizer): the plain form
    scale, offset = _q4_k_scales(gen, 1, 16, top)
    scale, offset = scale.expand(32, -1), offset.expand(32, -1)
    _, groups_, units = pack_vnni(codes[:32, :512], scale, offset)
    assert (groups_.dtype, units.numel() == 0) == ((torch.uint8, False) if top == 63
                                                   else (torch.float16, True))


def _vnni_reference(x, codes, scale16, offset16, bias):
    """What the VNNI kernel computes, in float64: activations quantized per row and group of
    32 to int8, integer dot products, the group's scale and offset terms."""
    m, k = x.shape
    xg = x.float().view(m, -1, 32)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    a = torch.round(xg * inv[..., None]).clamp(-128, 127).double()  # half to even, saturate
    d, s = (amax / 127).double(), xg.double().sum(-1)
    q = codes.double().view(codes.shape[0], -1, 32)
    dots = torch.einsum("mgk,ngk->mng", a, q)  # exact integers
    y = (dots * scale16.double()[None] * d[:, None, :]).sum(-1) + s @ offset16.double().t()
    return y if bias is None else y + bias.double()


def _off_grid(scale):
    """The scales moved off the compact form's grid: the layer packs them in the plain form."""
    return scale * (1 + 1e-3 * torch.rand(scale.shape, generator=torch.Generator().manual_seed(9)))


@needs_vnni
@pytest.mark.parametrize("form", ["compact", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_int4_linear_computes_int8_activations_against_its_weight(dtype, form):
    """Our kernel equals its specification (a float64 model of the same arithmetic) to float
    rounding, and the product with the de-quantized weight within the int8 activations'
    error; the weight it uses is the codes with the scales and offsets as given (compact form)
    or rounded to fp16 (plain form)."""
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    codes, scale, offset = quantize_int4_rtn(w)
    if form == "plain":
        scale = _off_grid(scale)
    bias = torch.randn(96)
    layer = Int4Linear(codes, scale, offset, bias, dtype, "cpu", kernel="vnni")
    assert layer.kernel == "vnni" and layer.compact == (form == "compact")
    x = torch.randn(7, 256).to(dtype)
    x[3, 32:64] = 0  # a group of zeros: no scale to divide by
    got = layer(x[None])[0]
    assert got.dtype == dtype and got.shape == (7, 96)
    stored = (scale, offset) if form == "compact" else (scale.half(), offset.half())
    spec = _vnni_reference(x, codes, *stored, bias)
    spec_tol = (1e-4 if dtype == torch.float32 else 2 ** -7) * spec.abs().max().item()
    assert (got.double() - spec).abs().max().item() <= spec_tol
    full = x.double() @ _dequantized(codes, scale, offset).t() + bias.double()
    assert (got.double() - full).abs().max().item() <= 0.03 * full.abs().max().item()
    err = (layer.dequantized().double() - _dequantized(codes, scale, offset)).abs()
    if form == "compact":
        assert not err.any()
    bound = (15 * scale.double().abs() + offset.double().abs()) * 2 ** -11
    assert (err <= bound.repeat_interleave(32, 1) + 1e-12).all()


@needs_vnni
@pytest.mark.parametrize("bias", [True, False])
def test_merged_int4_layers_keep_each_outputs_bits_and_hold_no_weight_twice(bias):
    """q, k and v (or gate and up) as one VNNI layer: each output has the bits its own layer
    gives, at any row count; the parts view the merged weights (one storage)."""
    from engine.parallel.workers import model_bytes

    gen = torch.Generator().manual_seed(3)
    sizes = (128, 32, 32)

    def layer(n):
        codes, scale, offset = quantize_int4_rtn(torch.randn(n, 256, generator=gen))
        return Int4Linear(codes, scale, offset, torch.randn(n, generator=gen) if bias else None,
                          torch.bfloat16, "cpu", kernel="vnni")

    parts = torch.nn.ModuleList(layer(n) for n in sizes)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    alone = [[p(x[:m]) for p in parts] for m in range(1, 9)]
    before = model_bytes(parts)
    merged = Int4Linear.merged(list(parts))
    assert merged.out_features == sum(sizes)
    for m in range(1, 9):
        assert torch.equal(merged(x[:m]), torch.cat(alone[m - 1], dim=-1))
        for p, want in zip(parts, alone[m - 1]):  # the parts, now views, compute as before
            assert torch.equal(p(x[:m]), want)
    both = torch.nn.ModuleList([*parts, merged])
    assert model_bytes(both) == before
    other = Int4Linear(*quantize_int4_rtn(torch.randn(32, 128, generator=gen)), None,
                       torch.bfloat16, "cpu", kernel="vnni")
    assert Int4Linear.merged([parts[0], other]) is None  # another input size
    codes, scale, offset = quantize_int4_rtn(torch.randn(32, 256, generator=gen))
    plain = Int4Linear(codes, _off_grid(scale), offset,
                       torch.randn(32, generator=gen) if bias else None, torch.bfloat16, "cpu",
                       kernel="vnni")
    compact = layer(32)
    assert compact.compact and not plain.compact
    y = compact(x), plain(x)
    both = Int4Linear.merged([compact, plain])  # the two forms: both plain, then merged
    assert not both.compact and not compact.compact and not plain.compact
    assert torch.equal(both(x)[:, 32:], y[1]) and torch.equal(compact(x), both(x)[:, :32])
    assert (compact(x).float() - y[0].float()).abs().max() <= 0.02 * y[0].abs().max()


@needs_vnni
@pytest.mark.parametrize("form", ["compact", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_kernel_gives_a_row_its_one_row_bits_at_any_row_count(dtype, form):
    """Every row has the bits it has alone, 1..20 rows (the kernel's passes of 8 rows and
    their remainders), with a bias, at a packaged shape, in either form of the scales."""
    gen = torch.Generator().manual_seed(5)
    codes, scale, offset = quantize_int4_rtn(torch.randn(256, 1536, generator=gen))
    if form == "plain":
        scale = _off_grid(scale)
    layer = Int4Linear(codes, scale, offset, torch.randn(256, generator=gen), dtype, "cpu",
                       kernel="vnni")
    assert layer.compact == (form == "compact")
    x = (torch.randn(20, 1536, generator=gen) * torch.logspace(-2, 2, 20)[:, None]).to(dtype)
    alone = torch.cat([layer.matmul(x[i:i + 1]) for i in range(20)])
    for m in (2, 3, 5, 8, 9, 16, 20):
        assert torch.equal(layer.matmul(x[:m]), alone[:m])
    spec = _vnni_reference(x, codes, *unpack_vnni(*layer.vnni_buffers)[1:], layer.bias)
    tol = (1e-4 if dtype == torch.float32 else 2 ** -7) * spec.abs().max().item()
    assert (layer.matmul(x).double() - spec).abs().max().item() <= tol


def test_int4_kernel_choice(monkeypatch):
    torch.manual_seed(0)
    parts = quantize_int4_rtn(torch.randn(48, 64))
    assert Int4Linear(*parts, None, torch.float16, "cpu").kernel == "torch"  # no fp16 form
    assert Int4Linear(*quantize_int4_rtn(torch.randn(48, 128), 64), None, torch.bfloat16,
                      "cpu", 64).kernel == "torch"  # groups of 64
    with pytest.raises(ValueError, match="vnni int4 kernel runs on the CPU"):
        Int4Linear(*parts, None, torch.float16, "cpu", kernel="vnni")
    with pytest.raises(ValueError, match="invalid int4 kernel"):
        Int4Linear(*parts, None, torch.bfloat16, "cpu", kernel="avx")
    monkeypatch.setattr(quant_linear, "vnni_kernel", lambda: "the CPU lacks avx512_vnni")
    assert Int4Linear(*parts, None, torch.bfloat16, "cpu").kernel == "torch"
    with pytest.raises(ValueError, match="not available: the CPU lacks avx512_vnni"):
        Int4Linear(*parts, None, torch.bfloat16, "cpu", kernel="vnni")
    with pytest.raises(ValueError, match="int4_kernel"):
        EngineConfig(int4_kernel="avx")


def test_int8_linear_matches_its_weight():
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    codes, scale = quantize_int8_rtn(w)
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    layer = Int8Linear(codes, scale, None, torch.float32, "cpu")
    x = torch.randn(5, 128)
    assert torch.allclose(layer(x), F.linear(x, codes.float() * scale[:, None]), atol=1e-4)


@pytest.mark.parametrize("kind", ["int4/torch", pytest.param("int4/vnni", marks=needs_vnni),
                                  "int8"])
def test_quantized_kernels_are_batch_invariant(kind):
    """Measured like the plain linears: a row's bits never depend on the other rows."""
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    layer = (Int4Linear(*quantize_int4_rtn(w), None, torch.bfloat16, "cpu",
                        kernel=kind.split("/")[1]) if kind.startswith("int4")
             else Int8Linear(*quantize_int8_rtn(w), None, torch.bfloat16, "cpu"))
    probe = torch.empty(64, 256, dtype=torch.bfloat16)
    assert invariant_row_range(probe, op=layer.matmul) is not None


@pytest.mark.parametrize("kind", ["int4/torch", pytest.param("int4/vnni", marks=needs_vnni),
                                  "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_rows_keep_their_bits(kind, dtype):
    """A draft's vocabulary subset: the layer of some output rows gives each the bits the
    whole layer gives it."""
    torch.manual_seed(3)
    w, bias = torch.randn(256, 128), torch.randn(256)
    layer = (Int4Linear(*quantize_int4_rtn(w), bias, dtype, "cpu", kernel=kind.split("/")[1])
             if kind.startswith("int4") else Int8Linear(*quantize_int8_rtn(w), bias, dtype, "cpu"))
    rows = torch.randperm(256)[:64].sort().values
    part = layer.select_rows(rows)
    assert part.out_features == 64 and type(part) is type(layer)
    x = torch.randn(3, 128).to(dtype)
    assert torch.equal(part(x), layer(x)[:, rows])


def _random_blocks(type_name: str, rows: int, blocks: int, rng) -> np.ndarray:
    """Random GGUF blocks of `type_name` with finite, ordinary fp16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    per_block, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(0.001, 0.05, size=(rows, blocks, halves)).astype(np.float16)
    data[..., :2 * halves] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return data.reshape(rows, blocks * nbytes), qtype, per_block


class _Tensor:  # what the decoder reads of a GGUFReader tensor
    def __init__(self, data, qtype, k):
        self.data, self.tensor_type, self.shape = data, qtype, [k, data.shape[0]]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_block_decoding_matches_gguf_dequantize(type_name):
    """Codes, scales and offsets decoded from blocks give exactly gguf's own de-quantization
    (which is what transformers loads): nothing is re-quantized."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    data, qtype, per_block = _random_blocks(type_name, rows=8, blocks=3, rng=rng)
    codes, scale, offset = quantize.gguf_int4_groups(_Tensor(data, qtype, 3 * per_block))
    assert codes.max() <= 15 and codes.shape == (8, 3 * per_block)
    ref = dequantize(data, qtype).astype(np.float64)
    mine = _dequantized(torch.from_numpy(codes), torch.from_numpy(scale),
                        torch.from_numpy(offset)).numpy()
    assert np.abs(mine - ref).max() <= 1e-6 * np.abs(ref).max()


def test_quantize_model_modes_and_stored_form(tmp_path):
    model = build_tiny_model("qwen2")
    counts = quantize.quantize_model(clone_model(model), "int4")
    assert counts["int4"] == 2 * 7 + 1 and counts["unchanged"] == 0
    counts = quantize.quantize_model(clone_model(model), "int8")
    assert counts["int8"] == 15
    # auto without a GGUF source serves the model as loaded
    assert quantize.quantize_model(clone_model(model), "auto")["int4"] == 0
    with pytest.raises(ValueError, match="invalid quantization"):
        quantize.quantize_model(clone_model(model), "int3")


def _engine(model, method="none", draft=None, dtype="float32", quant="int4",
            draft_quant="none", **kw):
    spec = SpeculativeConfig(method=method, draft_model="in-memory" if draft else None,
                             k_max=4, adaptive=False, draft_quantization=draft_quant,
                             **({"ngram_max_n": 3} if method == "ngram" else {}))
    return LLMEngine(EngineConfig(num_blocks=256, dtype=dtype, quantization=quant,
                                  speculative=spec, **kw),
                     model=clone_model(model), draft_model=clone_model(draft) if draft else None)


def _staggered(engine, prompts, params):
    return [o.output_token_ids for o in staggered(engine, prompts, params, arrive_every=1)]


@pytest.mark.parametrize("draft_quant,kernel", [("int4", "torch"), ("int8", "torch"),
                                                pytest.param("int4", "vnni", marks=needs_vnni)])
def test_int4_target_speculative_greedy_equals_plain_bf16(draft_quant, kernel):
    """bf16, batch of 8 with staggered arrivals, batch invariance on: the int4 target's greedy
    output is the same with a (quantized) draft model as without, and with n-gram drafts."""
    target = build_tiny_model("qwen2", dtype=torch.bfloat16)
    prompts = random_prompts([5, 9, 14, 3, 20, 7, 11, 6])
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain_engine = _engine(target, dtype="bfloat16", int4_kernel=kernel)
    assert isinstance(plain_engine.runner.model.lm_head, Int4Linear)
    assert plain_engine.runner.model.lm_head.kernel == kernel
    assert plain_engine.runner.invariance.invariant
    plain = [o.output_token_ids for o in plain_engine.generate(prompts, greedy)]
    spec_engine = _engine(target, "draft_model", target, dtype="bfloat16",
                          draft_quant=draft_quant, int4_kernel=kernel)
    draft_model = spec_engine.speculator.proposer.runner.model
    assert isinstance(draft_model.lm_head, Int4Linear if draft_quant == "int4" else Int8Linear)
    assert _staggered(spec_engine, prompts, greedy) == plain
    assert spec_engine.speculator.stats.acceptance_rate > 0.5
    ngram = _engine(target, "ngram", dtype="bfloat16", int4_kernel=kernel)
    assert _staggered(ngram, prompts, greedy) == plain
    for engine in (spec_engine, ngram):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_given_model_is_not_changed():
    target = build_tiny_model("qwen2")
    engine = LLMEngine(EngineConfig(num_blocks=64, quantization="int8"), model=target)
    assert type(target.lm_head) is torch.nn.Linear
    assert isinstance(engine.runner.model.lm_head, Int8Linear)


def test_bad_quantization_config_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int2")
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeConfig(draft_quantization="fp8")


@pytest.mark.real_model
def test_smollm2_gguf_blocks_are_kept_exactly(smollm2_path):
    """The stored form of SmolLM2's real Q4_1 blocks: its de-quantization equals the converted
    weights bit for bit (q/k rows un-permuted as transformers does), and an int4 layer built from
    it computes the bf16 reference layer within bf16 rounding."""
    from safetensors import safe_open

    stored = quantize.StoredGGUF.find(smollm2_path)
    assert stored is not None
    assert set(stored.types.values()) == {"Q4_1", "Q8_0"}  # lm_head is tied to Q8_0 embeddings
    ref = safe_open(f"{smollm2_path}/model.safetensors", "pt")
    names = [n for n, t in stored.types.items() if t == "Q4_1"]
    assert len(names) == 30 * 7
    for name in names[:7] + names[-7:]:
        codes, scale, offset = stored.int4_groups(name)
        weight = ref.get_tensor(f"{name}.weight")
        assert torch.equal(_dequantized(codes, scale, offset).float(), weight.float()), name
    codes, scale, offset = stored.int4_groups(names[0])
    weight = ref.get_tensor(f"{names[0]}.weight").to(torch.bfloat16)
    layer = Int4Linear(codes, scale, offset, None, torch.bfloat16, "cpu")
    x = torch.randn(9, weight.shape[1]).to(torch.bfloat16)
    ref_out = F.linear(x.float(), weight.float())
    assert (layer(x).float() - ref_out).abs().max() <= 0.02 * ref_out.abs().max()


@pytest.mark.real_model
def test_smollm2_auto_quantized_greedy_spec_equals_plain(smollm2_path):
    """The real model served from its GGUF (auto: int4, the Q4_1 blocks kept and the rest
    re-quantized), bf16: prompt lookup speculation changes nothing, alone or 8 at once."""
    from engine.models.loader import load_model

    tok = load_model(smollm2_path, dtype="bfloat16", device="cpu")[1]
    prompts = [tok.encode(p) for p in ("def fibonacci(n):", "The capital of France is",
                                       "List three uses of copper:", "Q: 12 times 12?\nA:")]
    greedy = SamplingParams(temperature=0, max_tokens=32)

    def engine(method):
        spec = SpeculativeConfig(method=method, k_max=4)
        return LLMEngine(EngineConfig(model=smollm2_path, dtype="bfloat16", device="cpu",
                                      quantization="auto", num_blocks=128, speculative=spec))

    plain_engine = engine("none")
    assert isinstance(plain_engine.runner.model.model.layers[0].mlp.up_proj, Int4Linear)
    assert isinstance(plain_engine.runner.model.lm_head, Int4Linear)
    plain = [o.output_token_ids for o in plain_engine.generate(prompts, greedy)]
    alone = [o.output_token_ids[:] for p in prompts
             for o in engine("ngram").generate([p], greedy)]
    assert alone == plain
    assert _staggered(engine("ngram"), prompts, greedy) == plain


def test_server_serves_an_int4_target_with_the_official_client(tmp_path):
    """`specserve serve --quantization int4`: the official client gets the int4 model's greedy
    tokens (the same as an in-process engine with the same setting), streamed or not."""
    import openai
    from server_utils import ServerProcess, save_tiny_model

    from engine.models.loader import load_model

    folder = save_tiny_model(tmp_path / "tiny")
    prompt = random_prompts([12], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    model, _ = load_model(str(folder), dtype="float32", device="cpu")
    expected = {}
    for quant in ("int4", "none"):
        engine = LLMEngine(EngineConfig(num_blocks=64, quantization=quant), model=model)
        expected[quant] = engine.generate([prompt], params)[0].output_token_ids
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--device", "cpu",
                         "--num-threads", "1", "--quantization", "int4"]).wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                        temperature=0, logprobs=1,
                                        extra_body={"ignore_eos": True})
        tokens = out.choices[0].logprobs.tokens
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
    finally:
        assert srv.terminate() == 0, srv.log()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert tokens == [tok.decode([t]) for t in expected["int4"]]
    assert streamed == out.choices[0].text
    assert "quantized linears (int4)" in srv.log_path.read_text()
