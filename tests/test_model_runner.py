"""The packed ragged forward through block tables equals a plain transformers forward."""

import pytest
import torch

from conftest import build_tiny_model, clone_model, random_prompts
from engine.batch import Drafts, RunItem
from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


def _execute_every_row(runner, scheduled):
    """Run one step asking for logits at every new position (as verifying drafts does):
    the first new token is committed, the rest are presented as draft tokens."""
    ids = [s.seq.token_ids for s in scheduled]
    result = runner.execute([RunItem(t[s.start:s.start + 1], s.start, s.seq.block_table,
                                     s.num_new_tokens) for s, t in zip(scheduled, ids)],
                            Drafts.gather([(t[s.start + 1:s.end], None)
                                           for s, t in zip(scheduled, ids)], runner.device))
    offs = result.row_offsets
    return [result.logits[offs[i]:offs[i + 1]] for i in range(len(scheduled))]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_mixed_prefill_chunks_and_decodes_match_full_forward(arch):
    ref = build_tiny_model(arch)
    runner = ModelRunner(clone_model(ref), num_blocks=64, block_size=16)
    bm = BlockManager(64, 16)
    first = [30, 5, 40, 16, 3, 1, 20]  # step 1: prompt chunks and whole prompts
    second = [40, 1, 1, 1, 30, 1, 4]  # step 2: chunks, decodes, verification-sized runs
    prompts = random_prompts([a + b for a, b in zip(first, second)], seed=3)
    seqs = [Sequence(str(i), p, SamplingParams()) for i, p in enumerate(prompts)]
    for chunk in (first, second):
        scheduled = []
        for seq, n in zip(seqs, chunk):
            assert bm.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledSeq(seq, n))
        rows = _execute_every_row(runner, scheduled)
        assert runner.kv.meta is None
        for sched, logits in zip(scheduled, rows):
            with torch.no_grad():
                full = ref(torch.tensor([sched.seq.token_ids[:sched.end]])).logits[0]
            torch.testing.assert_close(logits, full[sched.start:sched.end], atol=1e-4, rtol=0)
        for sched in scheduled:
            sched.seq.num_computed_tokens = sched.end


def test_only_sampled_rows_are_returned():
    ref = build_tiny_model("qwen2")
    runner = ModelRunner(clone_model(ref), num_blocks=16, block_size=16)
    bm = BlockManager(16, 16)
    a = Sequence("a", random_prompts([40])[0], SamplingParams())
    b = Sequence("b", random_prompts([10], seed=2)[0], SamplingParams())
    bm.allocate(a, 20)
    bm.allocate(b, 10)
    out = runner.execute([RunItem(a.token_ids[:20], 0, a.block_table, 0),
                          RunItem(b.token_ids, 0, b.block_table, 1)])
    assert out.row_offsets == [0, 0, 1]  # a's chunk does not reach its end
    with torch.no_grad():
        full = ref(torch.tensor([b.token_ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], full, atol=1e-4, rtol=0)


def test_a_model_whose_attention_bypasses_the_paged_cache_is_refused():
    """transformers routes attention through the registered function; if a model does not
    (here: switched back to SDPA), its outputs would ignore the KV cache, so the runner's
    first forward raises instead of serving them."""
    runner = ModelRunner(build_tiny_model("qwen2"), num_blocks=8, block_size=16)
    runner.lean = False  # transformers' own forward (the lean one calls our attention itself)
    runner.model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="does not run through the KV cache"):
        runner.execute([RunItem([5, 6, 7], 0, [0], 1)])
    assert runner.kv.meta is None
