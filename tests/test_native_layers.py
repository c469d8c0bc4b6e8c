"""The decoder layers in one C++ call (engine/models/native_layers.py) give every row the bits
the lean forward's Python loop gives it: decode and verification steps, alone and batched
(ragged), with captured layers, int4 Qwen2 and Llama in bf16 and fp32; a step that mixes a
prompt chunk with a decode runs the Python loop, and the decode's row is the same there."""

import pytest
import torch

from conftest import build_tiny_model, random_prompts
from engine.batch import RunItem
from engine.kernels import fused
from engine.kernels.quant_linear import vnni_kernel
from engine.model_runner import ModelRunner
from engine.models import native_layers
from engine.models.quantize import quantize_model

HAS_LOOP = not any(isinstance(k, str) for k in (native_layers.kernel(), fused.kernel(),
                                                vnni_kernel()))
pytestmark = pytest.mark.skipif(not HAS_LOOP, reason="the CPU has no AVX-512 VNNI")


def _runner(arch, dtype, capture=()):
    # head_dim 32: every fused op runs; int4 layers on the VNNI kernel, merged by the runner
    model = build_tiny_model(arch, dtype=dtype, num_attention_heads=2, num_key_value_heads=1)
    quantize_model(model, "int4")
    runner = ModelRunner(model, num_blocks=32, block_size=16, batch_invariant=True)
    if capture:
        runner.enable_capture(list(capture))
    return runner


@pytest.fixture
def count_loops(monkeypatch):
    calls = []
    real = native_layers.run

    def run(*args):
        calls.append(args[2].shape[0])
        return real(*args)

    monkeypatch.setattr(native_layers, "run", run)
    return calls


def _both(runner, items):
    """The step with the C++ loop, then with the Python loop (each rewrites the same K/V)."""
    out = []
    for enabled in (True, False):
        native_layers.ENABLED = enabled
        try:
            step = runner.execute(items)
        finally:
            native_layers.ENABLED = True
        out.append((step.logits, step.hidden))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loop_gives_the_python_loops_bits(arch, dtype, count_loops):
    runner = _runner(arch, dtype, capture=(0, 1))
    prompts = random_prompts([40, 3, 25, 9], seed=4)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(4)]
    runner.execute([RunItem(p, 0, t, 1, len(p)) for p, t in zip(prompts, tables)])
    assert not count_loops  # prompts: the Python loop
    steps = [
        [RunItem([7], 40, tables[0], 1, 40)],  # a decode
        [RunItem([8, 9, 10, 11, 12], 3, tables[1], 5, 3)],  # a verification of 1 + 4
        [RunItem([7], 40, tables[0], 1, 40), RunItem([8, 9, 10, 11, 12], 3, tables[1], 5, 3),
         RunItem([5, 6], 25, tables[2], 2, 25), RunItem([12], 9, tables[3], 1, 9)],
    ]
    alone = {}
    for items in steps:
        (a, ha), (b, hb) = _both(runner, items)
        assert torch.equal(a, b) and torch.equal(ha, hb)
        rows = 0
        for item in items:  # each item's rows are the ones it had alone
            key = (tuple(item.token_ids), item.start)
            mine = a[rows:rows + item.num_rows]
            assert torch.equal(alone.setdefault(key, mine), mine)
            rows += item.num_rows
    assert count_loops == [1, 5, 9]


def test_a_decode_batched_with_a_prompt_chunk_keeps_its_bits(count_loops):
    runner = _runner("qwen2", torch.bfloat16)
    prompts = random_prompts([30, 20], seed=2)
    runner.execute([RunItem(prompts[0], 0, [0, 1, 2], 1, 30)])
    decode = RunItem([9], 30, [0, 1, 2], 1, 30)
    alone = runner.execute([decode]).logits
    assert count_loops == [1]
    mixed = runner.execute([decode, RunItem(prompts[1], 0, [4, 5], 1, 20)]).logits
    assert count_loops == [1]  # a prompt's rows: the Python loop
    assert torch.equal(mixed[:1], alone)


def test_other_models_take_the_python_loop(count_loops):
    model = build_tiny_model("qwen2", dtype=torch.bfloat16, num_attention_heads=2,
                             num_key_value_heads=1)  # bf16 weights: no int4 layers
    runner = ModelRunner(model, num_blocks=16, block_size=16, batch_invariant=True)
    runner.execute([RunItem(random_prompts([10])[0], 0, [0], 1, 10)])
    runner.execute([RunItem([3], 10, [0], 1, 10)])
    assert not count_loops
    assert model.__dict__["_specserve_native_layers"] is False  # decided once
