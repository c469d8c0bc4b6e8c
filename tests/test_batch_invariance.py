"""Batch invariance: a row's result never depends on the other rows of the step.

Op level: every decoder layer's output and the logits for one row, computed alone, as the
first of 1 + k verification rows, as the last token of its prompt (whole, or a chunk with a
past), and inside a batch of mixed sequences (decodes, verifications, a prompt chunk), are
bit-identical, in bf16 and fp32.
"""

import pytest
import torch

from conftest import build_tiny_model, clone_model
from engine.batch import RunItem
from engine.model_runner import ModelRunner

BLOCK = 16
CONTEXT = 70  # the row under test is the token at position CONTEXT of sequence A


def capture(runner: ModelRunner, items: list[RunItem], row: int) -> list[torch.Tensor]:
    """Every decoder layer's output at flattened row `row`, then the logits of that row
    (its logits row is the first one item 0 wants)."""
    outputs = []
    hooks = [layer.register_forward_hook(
        lambda _m, _i, out: outputs.append((out[0] if isinstance(out, tuple) else out)
                                           [0, row].clone()))
        for layer in runner.model.model.layers]
    try:
        logits = runner.execute(items).logits
    finally:
        for hook in hooks:
            hook.remove()
    first_logit_row = sum(item.num_rows for item in items[:_item_of(items, row)])
    return outputs + [logits[first_logit_row].clone()]


def _item_of(items: list[RunItem], row: int) -> int:
    start = 0
    for i, item in enumerate(items):
        if start <= row < start + len(item.token_ids):
            return i
        start += len(item.token_ids)
    raise IndexError(row)


def cases(runner: ModelRunner, vocab: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    table_a = list(range(0, 8))
    others = [list(range(8 + 6 * i, 14 + 6 * i)) for i in range(31)]
    context_a = tokens(CONTEXT)
    runner.execute([RunItem(context_a, 0, table_a, 1)])  # A's K/V up to CONTEXT - 1
    token, drafts = tokens(1), tokens(4)
    out = {"alone": capture(runner, [RunItem(token, CONTEXT, table_a, 1)], 0),
           "verify 1+4": capture(runner, [RunItem(token + drafts, CONTEXT, table_a, 5)], 0),
           # the row inside a prompt: computed from position 0, and as a chunk with a past
           "whole prompt": capture(runner, [RunItem(context_a + token, 0, table_a, 1)], CONTEXT),
           "prompt chunk": capture(runner, [RunItem(context_a[40:] + token, 40, table_a, 1)],
                                   CONTEXT - 40)}
    batch = []  # 31 other sequences: decodes, verifications and a prompt chunk
    for i, table in enumerate(others):
        if i == 7:
            batch.append(RunItem(tokens(40), 0, table, 1))
        elif i % 3 == 0:
            batch.append(RunItem(tokens(4), 20 + i, table, 4))
        else:
            batch.append(RunItem(tokens(1), 10 + 2 * i, table, 1))
    for at in (0, 12, 31):  # A first, in the middle, last
        items = batch[:at] + [RunItem(token + drafts[:2], CONTEXT, table_a, 3)] + batch[at:]
        row = sum(len(item.token_ids) for item in items[:at])
        out[f"batch of 32, at {at}"] = capture(runner, items, row)
    return out


def mismatches(results: dict[str, list[torch.Tensor]]) -> list[str]:
    ref = results["alone"]
    return [f"{name}: layer {i}" for name, got in results.items()
            for i, (a, b) in enumerate(zip(ref, got)) if not torch.equal(a, b)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_layer_of_a_row_is_bit_identical_alone_verified_or_batched(dtype):
    model = build_tiny_model("qwen2", dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.div_(8.0)  # ordinary logits, not sharpened ones
    runner = ModelRunner(clone_model(model), 256, BLOCK, batch_invariant=True)
    assert runner.invariance.invariant, runner.invariance.problems
    assert mismatches(cases(runner, model.config.vocab_size)) == []


def test_without_the_rule_rows_do_depend_on_the_batch():
    """The test above has teeth: in fp32 the same cases differ without the rule."""
    model = build_tiny_model("qwen2", dtype=torch.float32)
    runner = ModelRunner(clone_model(model), 256, BLOCK, batch_invariant=False)
    assert mismatches(cases(runner, model.config.vocab_size)) != []
