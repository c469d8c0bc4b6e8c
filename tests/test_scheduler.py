"""Scheduler tests with fake runner outputs: no model, no torch."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus

EOS = 1


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=256, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(budget, max_seqs, max_len), bm, {EOS})


def add(sched, rid, prompt_len, max_tokens=4, first=10):
    seq = Sequence(rid, list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def fake_step(sched, token=7):
    """Schedule, then commit `token` for every sequence whose scheduled tokens reach its end."""
    out = sched.schedule()
    tokens = [[token] if s.num_sample_rows else [] for s in out.scheduled]
    sched.update(out, tokens)
    return out


def verify_step(sched, seq, emitted):
    """A step that verifies len(emitted) - 1 drafts of `seq` (its only running sequence) and
    emits `emitted`, as a verifier that accepted them all would."""
    seq.num_draft_tokens = len(emitted) - 1
    out = sched.schedule()
    sched.update(out, [emitted])
    return out


def test_prefill_then_decode_one_token_each():
    sched = make()
    a = add(sched, "a", 5)
    out = fake_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5)]
    assert a.num_computed_tokens == 5 and a.token_ids[-1] == 7
    out = fake_step(sched)
    assert out.scheduled[0].num_new_tokens == 1
    assert a.num_computed_tokens == 6 and a.num_output_tokens == 2


def test_chunked_prefill_respects_budget():
    sched = make(budget=8)
    a = add(sched, "a", 20)
    b = add(sched, "b", 3)
    out = fake_step(sched)
    assert out.num_batched_tokens == 8
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8)]
    assert a.num_output_tokens == 0  # chunk did not reach the end: nothing sampled
    out = fake_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8)]
    out = fake_step(sched)  # last 4 of a, then b's 3 fit in the same budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 4), ("b", 3)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    for _ in range(10):
        out = fake_step(sched)
        assert out.num_batched_tokens <= 8


def test_max_num_seqs_limits_running():
    sched = make(max_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 2)
    fake_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_multiple_new_tokens_per_running_sequence():
    """A running sequence may be scheduled for 1 + k tokens (verification of drafts)."""
    sched = make()
    a = add(sched, "a", 5, max_tokens=20)
    fake_step(sched)
    a.num_draft_tokens = 3
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4
    assert out.scheduled[0].num_drafts == 3
    assert out.scheduled[0].num_sample_rows == 4
    # the verifier accepted 2 drafts and sampled one more token
    sched.update(out, [[20, 21, 30]])
    assert a.output_token_ids == [7, 20, 21, 30]
    assert a.num_computed_tokens == a.num_tokens - 1  # the rejected slot is rolled back
    assert a.num_draft_tokens == 0


def test_stop_inside_accepted_run_never_emits_past_it():
    sched = make()
    a = add(sched, "a", 5, max_tokens=3)
    fake_step(sched)
    verify_step(sched, a, [20, 21, 22, 23])
    assert a.output_token_ids == [7, 20, 21] and a.finish_reason == "length"
    b = add(sched, "b", 5, max_tokens=10, first=40)
    fake_step(sched)
    verify_step(sched, b, [20, EOS, 22, 23])
    assert b.output_token_ids == [7, 20, EOS] and b.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_finish_frees_blocks_and_stop_token_ids():
    sched = make()
    a = Sequence("a", [3, 4, 5], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    sched.add(a)
    fake_step(sched, token=8)
    fake_step(sched, token=9)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "stop"
    assert a.output_token_ids == [8, 9]  # the stop token is the last one committed
    assert not sched.has_unfinished
    assert sched.block_manager.num_free_blocks == 64


def test_context_length_finishes_with_length():
    sched = make(max_len=8)
    a = add(sched, "a", 6, max_tokens=100)
    while sched.has_unfinished:
        fake_step(sched)
    assert a.num_tokens == 8 and a.finish_reason == "length"


def test_preemption_when_blocks_run_out_and_resume():
    # 6 blocks of 4 tokens; two sequences of 8-token prompts each take 2 blocks (+1 on growth)
    sched = make(num_blocks=6, block_size=4, budget=64)
    a = add(sched, "a", 8, max_tokens=12)
    b = add(sched, "b", 8, max_tokens=12, first=50)
    fake_step(sched)
    assert len(sched.running) == 2
    preempted = []
    steps = 0
    while sched.has_unfinished:
        out = fake_step(sched)
        preempted += out.preempted
        steps += 1
        assert steps < 200
        used = sum(len(s.block_table) for s in sched.running)
        assert used <= 6
    assert preempted and preempted[0] is b  # the newest is preempted first
    assert sched.stats.num_preemptions == len(preempted)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert b.num_preemptions >= 1
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_sequence_recomputes_all_committed_tokens():
    sched = make(num_blocks=5, block_size=4, budget=64, prefix=False)
    a = add(sched, "a", 8, max_tokens=12)
    b = add(sched, "b", 8, max_tokens=12, first=50)
    fake_step(sched)
    while not b.num_preemptions:
        fake_step(sched)
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    committed = b.num_tokens
    while b.status is SequenceStatus.WAITING:
        out = fake_step(sched)
    resumed = [s for s in out.scheduled if s.seq is b]
    assert resumed and resumed[0].num_new_tokens == committed
    del a


def test_prefix_cache_hit_skips_computing_shared_blocks():
    sched = make(block_size=4)
    a = add(sched, "a", 12, max_tokens=1)
    fake_step(sched)
    assert a.is_finished
    b = Sequence("b", list(range(10, 18)) + [99, 98], SamplingParams(max_tokens=1))
    sched.add(b)
    out = fake_step(sched)
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].num_new_tokens == 2
    assert sched.block_manager.prefix_stats.hits == 8


def test_abort_frees_and_removes():
    sched = make()
    a = add(sched, "a", 5, max_tokens=50)
    add(sched, "b", 5)
    fake_step(sched)
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a not in sched.running
    assert sched.abort("nope") is None
