"""The engine on CUDA (run by `make gpu-check`; skipped without a GPU): bf16 greedy output with
speculation equals plain, alone and batched, on the Triton attention backend, with no leak."""

import pytest
import torch
from conftest import build_tiny_model, random_prompts, staggered

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def engine(target, method="none", draft=None, tree_max_nodes=0, **kw):
    spec = SpeculativeConfig(method=method, draft_model="in-memory" if draft else None,
                             k_max=4, adaptive=True, tree_max_nodes=tree_max_nodes)
    cfg = dict(num_blocks=512, max_num_seqs=16, cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
    cfg.update(kw)
    return LLMEngine(EngineConfig(speculative=spec, **cfg), model=target, draft_model=draft)


def fresh(seed=0):
    return build_tiny_model("qwen2", seed=seed, dtype=torch.bfloat16, num_layers=3).cuda()


def test_auto_picks_the_triton_backend_on_cuda():
    eng = engine(fresh())
    assert eng.runner.attention_backend == "triton"
    assert eng.runner.invariance is not None and eng.runner.invariance.invariant, \
        eng.runner.invariance.problems


@pytest.mark.parametrize("method,kv_split", [("draft_model", 0), ("ngram", 0), ("suffix", 0),
                                             ("hybrid", 0), ("draft_model", 32)])
def test_bf16_greedy_with_speculation_equals_plain_alone_and_batched(method, kv_split):
    """kv_split 32: split-KV attention over contexts of up to 5 splits."""
    prompts = random_prompts([5, 40, 17, 90, 3, 64, 28, 11], seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain_eng = engine(fresh(), attention_kv_split=kv_split)
    plain = [plain_eng.generate([p], params)[0].output_token_ids for p in prompts]
    draft = fresh(seed=1) if method in ("draft_model", "hybrid") else None
    eng = engine(fresh(), method, draft, attention_kv_split=kv_split)
    assert [o.output_token_ids for o in staggered(eng, prompts, [params] * len(prompts))] \
        == plain
    assert [eng.generate([p], params)[0].output_token_ids for p in prompts] == plain
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_bf16_greedy_token_trees_equal_plain_alone_and_batched(method):
    """Tree steps (tree attention in the Triton kernel, KV compaction of the accepted path) on
    CUDA: the same tokens as plain decoding."""
    prompts = random_prompts([5, 40, 17, 90, 3, 64, 28, 11], seed=5)
    prompts = [p + p[:12] + p for p in prompts]  # repeats, so suffix proposals branch
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain_eng = engine(fresh())
    plain = [plain_eng.generate([p], params)[0].output_token_ids for p in prompts]
    draft = fresh(seed=1) if method == "draft_model" else None
    eng = engine(fresh(), method, draft, tree_max_nodes=16)
    assert [o.output_token_ids for o in staggered(eng, prompts, [params] * len(prompts))] \
        == plain
    assert [eng.generate([p], params)[0].output_token_ids for p in prompts] == plain
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("graphs", ["auto", "off"])
@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
def test_a_step_synchronizes_only_in_its_one_fetch(method, graphs, monkeypatch):
    """torch's sync debug mode raises on any synchronizing call (a blocking copy, .item(),
    .tolist() of a device tensor, ...) outside `device_io.fetch`: the target pass, sampling,
    verification, logprobs and the draft model's chained forwards (whose drafts stay on the
    device for the next step) synchronize once per step, in its fetch."""
    from engine import device_io

    fetch = device_io.fetch
    fetches = [0]

    def allowed(*tensors):
        fetches[0] += 1
        torch.cuda.set_sync_debug_mode("default")
        try:
            return fetch(*tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(device_io, "fetch", allowed)
    draft = fresh(seed=1) if method == "draft_model" else None
    eng = engine(fresh(), method, draft, cuda_graphs=graphs, cuda_graph_batch_sizes=[1, 4])
    prompts = random_prompts([5, 40, 17], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=16, ignore_eos=True)]
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    eng.step()  # the first step (prefill) may allocate pinned memory and compile kernels
    torch.cuda.synchronize()
    steps = 0
    try:
        torch.cuda.set_sync_debug_mode("error")
        while eng.has_unfinished():
            fetches[0] = 0
            outputs = eng.step()
            assert fetches[0] == (1 if any(o.new_token_ids for o in outputs) else 0)
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps >= 4


def test_the_kv_pool_is_sized_after_the_cuda_graphs():
    """A pool asked larger than the device leaves shrinks to what is left under
    gpu_memory_utilization once weights, the largest step and the graphs are accounted; the
    engine then stays under it with every bucket captured."""
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    before = torch.cuda.memory_allocated()
    util = before / total + 0.03
    eng = engine(fresh(), "ngram", num_blocks=None, kv_cache_memory_gb=total / (1 << 30),
                 gpu_memory_utilization=util, cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert eng.runner.static is not None
    replays = eng.runner.static.num_replays  # start-up calibration replays its buckets
    assert 1000 < eng.block_manager.num_blocks
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < util * total
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(eng.generate(random_prompts([5, 9], seed=1), params)) == 2
    assert eng.runner.static.num_replays > replays
    assert torch.cuda.max_memory_allocated() < util * total


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_linears_on_cuda_compute_their_weights(kind):
    """int4 through `_weight_int4pack_mm`, int8 through `_weight_int8pack_mm` (or a clear
    refusal where this torch has no CUDA kernel for it), against the de-quantized weight."""
    from engine.kernels.quant_linear import (Int4Linear, Int8Linear, quantize_int4_rtn,
                                             quantize_int8_rtn)

    torch.manual_seed(0)
    w = torch.randn(256, 512)
    x = torch.randn(5, 512).to(torch.bfloat16).cuda()
    if kind == "int4":
        codes, scale, offset = quantize_int4_rtn(w)
        layer = Int4Linear(codes, scale, offset, None, torch.bfloat16, "cuda")
        ref = (codes.float().view(256, -1, 32) * scale[..., None]
               + offset[..., None]).view(256, 512)
    else:
        codes, scale = quantize_int8_rtn(w)
        try:
            layer = Int8Linear(codes, scale, None, torch.bfloat16, "cuda")
        except ValueError as exc:
            assert "int8 linears do not run on cuda" in str(exc)
            return
        ref = codes.float() * scale[:, None]
    got = layer(x).float()
    want = x.float() @ ref.cuda().t()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_int4_target_greedy_speculation_equals_plain_on_cuda():
    prompts = random_prompts([5, 40, 17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine(fresh(), quantization="int4").generate(prompts, params)
    eng = engine(fresh(), "ngram", quantization="int4")
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == \
        [o.output_token_ids for o in plain]


def test_keyed_noise_has_the_same_bits_on_cuda_as_on_the_cpu():
    """A seeded request's uniforms are integer arithmetic: the same on every device."""
    from engine.sample.keys import noise_key
    from engine.sample.sampler import keyed_uniforms

    keys = [noise_key(seed, t) for seed in (0, 7, 2**62) for t in (0, 1, 300)]
    cpu = keyed_uniforms(keys, 151_936, torch.device("cpu"))
    assert torch.equal(keyed_uniforms(keys, 151_936, torch.device("cuda")).cpu(), cpu)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_two_gpu_tensor_parallel_greedy_with_speculation_equals_plain(method):
    """NCCL, ranks on cuda:0 and cuda:1 (the target given on the host: each rank moves its
    share); the draft model on rank 0's device."""
    target = build_tiny_model("qwen2", dtype=torch.bfloat16, num_layers=3)
    draft = build_tiny_model("qwen2", seed=1, dtype=torch.bfloat16, num_layers=1).cuda() \
        if method == "draft_model" else None
    prompts = random_prompts([5, 40, 17, 90, 3, 64], seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eng = engine(target, method, draft, device="cuda", dtype="bfloat16",
                 tensor_parallel_size=2)
    try:
        assert eng.workers.group.backend == "nccl" and eng.workers.invariant
        plain = SamplingParams(**{**params.__dict__, "speculative": False})
        expected = [eng.generate([p], plain)[0].output_token_ids for p in prompts]
        assert [o.output_token_ids for o in staggered(eng, prompts, params)] == expected
    finally:
        eng.close()
