"""Tensor parallelism on the CPU: two ranks (gloo, two processes) of tiny models.

Speculation stays exact under a split target (greedy and seeded output with speculation equal
the same engine's plain output, alone and in a batch); a split forward's logits match one
rank's within a stated tolerance; prefix-cache hits and preemption work; bad configurations are
refused at start-up; a rank that dies fails the engine loudly, never a hang."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

from conftest import build_tiny_model, make_engine, random_prompts, staggered
from engine import SamplingParams, StepError
from engine.batch import RunItem
from engine.parallel.shard import devices, shard_model, shard_shape
from server_utils import ServerProcess, save_tiny_model

pytestmark = pytest.mark.skipif(devices(torch.device("cpu")) < 2,
                                reason="tensor parallelism over 2 ranks needs 2 CPU cores")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)


def _prompts():
    """Random prompts, and prompts that repeat themselves (suffix matches find drafts)."""
    loop = random_prompts([9], seed=5)[0]
    return random_prompts([5, 23, 40], seed=3) + [loop * 4, (loop[:5] + [7]) * 6]


def _run(engine, prompts, params, batched: bool):
    """Token ids of each prompt: all in one staggered batch, or one request at a time."""
    if batched:
        outs = staggered(engine, prompts, params, arrive_every=2)
    else:
        outs = [engine.generate([p], params)[0] for p in prompts]
    return [o.output_token_ids for o in outs]


def _plain(params: SamplingParams) -> SamplingParams:
    """The same request opted out of speculation (a true plain step in the same engine)."""
    return SamplingParams(**{**params.__dict__, "speculative": False})


@pytest.fixture(scope="module")
def target():
    return build_tiny_model("qwen2", dtype=torch.bfloat16, num_layers=3)


@pytest.fixture(scope="module")
def draft():
    return build_tiny_model("qwen2", dtype=torch.bfloat16, num_layers=1)  # the target's layer 0


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_speculation_under_two_ranks_equals_plain_alone_and_batched(target, draft, method):
    """bf16, the dtype we serve: with drafts verified against the split target, greedy and
    seeded output equal plain decoding's in the same engine, request by request and in a
    staggered batch where requests verify drafts while others run plain."""
    engine = make_engine(target, method, draft if method == "draft_model" else None,
                         dtype="bfloat16", tensor_parallel_size=2)
    try:
        assert engine.workers is not None and engine.workers.invariant
        prompts = _prompts()
        for params in (GREEDY, SEEDED):
            plain = _run(engine, prompts, _plain(params), batched=False)
            assert _run(engine, prompts, params, batched=False) == plain, params
            mixed = [params if i % 2 else _plain(params) for i in range(len(prompts))]
            assert _run(engine, prompts, mixed, batched=True) == plain, params
        stats = engine.speculator.stats
        assert stats.by_method[method][2] > 0  # drafts were accepted: speculation ran
    finally:
        engine.close()


def test_token_trees_under_two_ranks_equal_plain(target):
    """A suffix proposal that branches (two earlier texts continue the same context two ways),
    verified against the split target: every rank moves the accepted path's K/V, and the
    output is plain decoding's."""
    engine = make_engine(target, "suffix", dtype="bfloat16", tensor_parallel_size=2,
                         tree_max_nodes=16)
    try:
        base = random_prompts([14], seed=11)[0]
        long = [SamplingParams(**{**p.__dict__, "max_tokens": 80}) for p in (GREEDY, SEEDED)]
        first = engine.generate([base], _plain(long[0]))[0].output_token_ids
        other = base + first[:1] + random_prompts([20], seed=12)[0]  # the other branch
        engine.generate([other], _plain(long[0]))
        moved = []
        compact = engine.runner.compact
        engine.runner.compact = lambda m: (moved.extend(m), compact(m))
        for params in long:  # the steps after the tree read the moved K/V on every rank
            plain = engine.generate([base], _plain(params))[0].output_token_ids
            assert engine.generate([base], params)[0].output_token_ids == plain, params
        assert engine.speculator.stats.num_tree_verifications > 0 and moved
    finally:
        engine.close()


@pytest.mark.parametrize("method,tree", [("eagle", 0), ("hybrid", 0), ("eagle", 16)])
def test_a_draft_head_reads_the_split_targets_features_and_stays_exact(tmp_path, method, tree):
    """The head on rank 0 reads the whole hidden states (every rank has them after each
    reduce), and is accepted for the target it was made for although rank 0 holds a share;
    its token trees (tree > 0) too."""
    from engine.spec_decode.eagle import EagleHead, head_config, initialize_from_target, save_head

    target = build_tiny_model("qwen2", num_layers=4)
    head = EagleHead(head_config(target, "tiny", list(range(320))))
    initialize_from_target(head, target)
    save_head(head, str(tmp_path / "head"))
    engine = make_engine(target, method, speculator=str(tmp_path / "head"), k_max=3,
                         tensor_parallel_size=2, tree_max_nodes=tree)
    try:
        prompts = _prompts()
        plain = _run(engine, prompts, _plain(GREEDY), batched=False)
        assert _run(engine, prompts, GREEDY, batched=True) == plain
        drafted = {m: c[1] for m, c in engine.speculator.stats.by_method.items()}
        assert drafted.get("eagle" if method == "eagle" else "suffix", 0) > 0, drafted
        if tree:
            assert engine.speculator.stats.tree_verifications_by_method.get("eagle", 0) > 0
    finally:
        engine.close()


def _logits(engine, prompts):
    """The target's logits at every position of `prompts`, one forward of all of them."""
    items, at = [], 0
    for p in prompts:
        blocks = -(-len(p) // 16)
        items.append(RunItem(p, 0, list(range(at, at + blocks)), len(p), len(p)))
        at += blocks
    return engine.runner.execute(items).logits


@pytest.mark.parametrize("dtype,kv_heads,tolerance", [
    ("float32", 2, 1e-5), ("bfloat16", 2, 2e-2), ("bfloat16", 1, 2e-2)],
    ids=["fp32", "bf16", "bf16-replicated-kv"])
def test_two_ranks_compute_one_ranks_logits_within_tolerance(dtype, kv_heads, tolerance):
    """A split forward differs from the whole one only by the order of its sums: within
    `tolerance` x the largest logit (bf16: the rounding of the row-parallel partials), and the
    same argmax almost everywhere. kv_heads 1: each rank holds a replica of the one KV head."""
    model = build_tiny_model("qwen2", dtype=getattr(torch, dtype), num_layers=3,
                             num_key_value_heads=kv_heads)
    prompts = random_prompts([7, 30, 61], seed=11)
    one = make_engine(model, dtype=dtype)
    two = make_engine(model, dtype=dtype, tensor_parallel_size=2)
    try:
        assert two.runner.kv.k[0].shape[2] == 1  # its share of the KV heads (or a replica)
        a, b = _logits(one, prompts), _logits(two, prompts)
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() <= tolerance * scale
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.97
    finally:
        two.close()


def test_prefix_cache_hits_and_preemption_under_two_ranks(target):
    """A pool too small for the batch preempts and recomputes; prompts sharing a prefix hit
    the cache: the output is the split engine's own output with room for everything."""
    shared = random_prompts([48], seed=21)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 14, 20], seed=22)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_engine(target, dtype="bfloat16", tensor_parallel_size=2)
    try:
        expected = [o.output_token_ids for o in roomy.generate(prompts, params)]
    finally:
        roomy.close()
    tight = make_engine(target, "suffix", dtype="bfloat16", tensor_parallel_size=2,
                        num_blocks=12)
    try:
        assert _run(tight, prompts, params, batched=True) == expected
        assert tight.scheduler.stats.num_preemptions > 0
        assert tight.block_manager.prefix_stats.hits > 0
    finally:
        tight.close()


def test_a_split_model_keeps_its_share_of_heads_and_mlp():
    model = build_tiny_model("qwen2", num_key_value_heads=1)
    shape = shard_shape(model.config, 2)
    assert (shape.heads, shape.kv_heads, shape.kv_replicas, shape.intermediate) == (2, 1, 2, 64)
    whole = model.model.layers[0]
    for rank in (0, 1):
        part = shard_model(model, rank, 2, owned=False).model.layers[0]
        q = whole.self_attn.q_proj.weight[rank * 32:(rank + 1) * 32]
        assert torch.equal(part.self_attn.q_proj.weight, q)
        assert torch.equal(part.self_attn.k_proj.weight, whole.self_attn.k_proj.weight)  # replica
        assert torch.equal(part.mlp.down_proj.weight,
                           whole.mlp.down_proj.weight[:, rank * 64:(rank + 1) * 64])
        assert torch.equal(part.self_attn.q_proj.bias, whole.self_attn.q_proj.bias[
            rank * 32:(rank + 1) * 32])
    assert model.config.num_attention_heads == 4  # the caller's model is untouched


def test_a_shares_stored_int4_groups_are_its_slice_of_the_whole_layers():
    """What quantization does with a GGUF's stored groups for a share (rows of a
    column-parallel layer, group-aligned columns of a row-parallel one): the same codes, scales
    and offsets as quantizing the share's own weights group by group (as a Q4_0/Q4_1 file's
    groups are, each on its own)."""
    from engine.models.quantize import _slice_groups

    def quantize_int4_rtn(w):  # each group from its own minimum and maximum
        w = w.detach().float().reshape(w.shape[0], -1, 32)
        lo, hi = w.amin(-1), w.amax(-1)
        step = (hi - lo) / 15
        codes = ((w - lo[..., None]) / step[..., None]).round().clamp(0, 15)
        return codes.reshape(w.shape[0], -1).to(torch.uint8), step, lo

    model = build_tiny_model("qwen2", num_key_value_heads=1)
    for rank in (0, 1):
        part = shard_model(model, rank, 2, owned=False).model.layers[1]
        whole = model.model.layers[1]
        for attr in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            share, full = part.get_submodule(attr), whole.get_submodule(attr)
            sliced = _slice_groups(share, *quantize_int4_rtn(full.weight))
            for got, want in zip(sliced, quantize_int4_rtn(share.weight)):
                assert torch.equal(got, want), (rank, attr)


@pytest.mark.parametrize("build,config,message", [
    (dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48), {},
     "does not divide the model's 3 attention heads"),
    (dict(num_attention_heads=4, num_key_value_heads=3, hidden_size=48), {},
     "KV heads must be a multiple of it or divide it"),
    (dict(intermediate_size=96), dict(quantization="int4"),
     "quantization int4 cannot split down_proj"),
    ({}, dict(cuda_graphs="static"), "static steps do not run with tensor_parallel_size"),
    ({}, dict(tensor_parallel_size=None), "more than the"),
], ids=["heads", "kv-heads", "int4-groups", "static-steps", "more-than-devices"])
def test_a_split_that_cannot_run_is_a_clear_error_at_start_up(build, config, message):
    model = build_tiny_model("qwen2", **build)
    config = {"tensor_parallel_size": 2, **config}
    if config["tensor_parallel_size"] is None:
        config["tensor_parallel_size"] = devices(torch.device("cpu")) + 1
    with pytest.raises(ValueError, match="tensor_parallel_size|cuda_graphs") as err:
        make_engine(model, **config)
    assert message in str(err.value)


def test_a_model_without_the_lean_forward_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=1))
    with pytest.raises(ValueError, match="runs Qwen2 and Llama models"):
        make_engine(model, tensor_parallel_size=2)


def test_int4_target_split_over_two_ranks_stays_exact_with_speculation(target, draft):
    """Quantized shares: each rank's int4 layers are its slice of the whole layer's groups."""
    engine = make_engine(target, "draft_model", draft, dtype="bfloat16", quantization="int4",
                         tensor_parallel_size=2)
    try:
        prompts = _prompts()[:3]
        assert _run(engine, prompts, GREEDY, batched=True) == _run(
            engine, prompts, _plain(GREEDY), batched=False)
    finally:
        engine.close()


def test_a_dead_rank_fails_the_step_and_the_engine_loudly(target):
    from server.engine_client import EngineClient

    engine = make_engine(target, dtype="bfloat16", tensor_parallel_size=2)
    try:
        assert engine.healthy()
        os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
        engine.workers.procs[0].join(10)
        assert not engine.healthy()
        engine.add_request([3, 4, 5], GREEDY)
        started = time.monotonic()
        with pytest.raises(StepError) as err:
            engine.step()
        assert not err.value.intact and time.monotonic() - started < 10
    finally:
        engine.close()

    engine = make_engine(target, dtype="bfloat16", tensor_parallel_size=2)
    client = EngineClient.in_thread(engine)
    client.start()
    try:
        os.kill(engine.workers.procs[0].pid, signal.SIGKILL)  # while idle
        deadline = time.monotonic() + 10
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.alive and "rank" in client.failure
    finally:
        client.shutdown()


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_server_with_two_ranks_reports_them_and_exits_when_one_dies(tmp_path, engine_process):
    folder = save_tiny_model(tmp_path / "tiny")
    srv = ServerProcess(["--model", str(folder), "--served-model-name", "tiny", "--device",
                         "cpu", "--tensor-parallel-size", "2",
                         *(["--engine-process"] if engine_process else [])]).wait_ready()
    try:
        ready = httpx.get(srv.url + "/ready").json()
        assert ready["tensor_parallel"] == [{"rank": 0, "alive": True},
                                            {"rank": 1, "alive": True}]
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 8, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'specserve:tensor_parallel_rank_up{rank="1"} 1.0' in metrics
        assert 'tensor_parallel_rank_memory_bytes{kind="kv_cache",rank="1"}' in metrics
        pid = int(srv.log().split("tensor-parallel rank 1 started (pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)
        assert srv.proc.wait(30) == 1
        assert "tensor-parallel rank 1 exited" in srv.log()
    finally:
        srv.terminate()


def test_engine_client_sees_ranks_in_its_snapshot(target):
    from engine.engine_stats import describe, snapshot

    engine = make_engine(target, dtype="bfloat16", tensor_parallel_size=2)
    try:
        info, stats = describe(engine), snapshot(engine)
        assert info.tensor_parallel_size == 2 and info.batch_invariant
        assert [(r, alive) for r, alive, *_ in stats.ranks] == [(0, True), (1, True)]
        assert all(w > 0 and kv > 0 for *_, w, kv in stats.ranks)
    finally:
        engine.close()
