"""The runner's lean forward (engine/models/lean_forward.py) with torch's ops between the
matmuls gives the bits of the models' own forward through the paged cache, on a step mixing prompt chunks, decodes and verification
rows, in fp32 and bf16, with batch invariance on, with int4 linears too."""

import pytest
import torch

from conftest import build_tiny_model, random_prompts
from engine.batch import RunItem
from engine.model_runner import ModelRunner
from engine.kernels import fused
from engine.models import lean_forward
from engine.models.quantize import quantize_model


def _steps(runner):
    prompts = random_prompts([40, 3, 25, 9], seed=4)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(4)]
    first = [RunItem(p[:n], 0, t, 2, len(p)) for p, t, n in zip(prompts, tables, (20, 3, 25, 9))]
    second = [RunItem(prompts[0][20:], 20, tables[0], 1, 40),  # the rest of a prompt
              RunItem([7], 3, tables[1], 1, 3),  # a decode
              RunItem([8, 9, 10, 11], 25, tables[2], 4, 25),  # a verification of 1 + 3
              RunItem([12], 9, tables[3], 1, 9)]
    return [runner.execute(items).logits for items in (first, second)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None),
                                         (torch.bfloat16, "int4")])
def test_lean_forward_gives_the_models_own_bits(arch, dtype, quant, monkeypatch):
    # torch's ops between the matmuls, as the models' own forward has them (the fused ops
    # round differently: tests/test_fused_ops.py)
    monkeypatch.setattr(fused, "ENABLED", False)
    model = build_tiny_model(arch, dtype=dtype)
    if quant:
        quantize_model(model, quant)
    assert lean_forward.supported(model)
    runner = ModelRunner(model, num_blocks=32, block_size=16, batch_invariant=True)
    assert runner.lean
    lean = _steps(runner)
    runner.lean = False
    runner.kv.k = [torch.zeros_like(t) for t in runner.kv.k]
    runner.kv.v = [torch.zeros_like(t) for t in runner.kv.v]
    own = _steps(runner)
    for a, b in zip(lean, own):
        assert torch.equal(a, b)
