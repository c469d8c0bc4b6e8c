"""The step's drafts object, the runner plan and the row rules: small and CPU-only."""

import pytest
import torch

from engine.batch import UNKNOWN, Drafts, RunItem, input_ids
from engine.config import EngineConfig
from engine.runner_plan import RunnerPlan
from engine.sample import keys
from engine.sample.row_spec import by_pick, draft_stream, row_spec
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

CPU = torch.device("cpu")


def test_drafts_are_flat_over_sequences_wherever_they_are_held():
    """Host drafts, device drafts and none, in one step: one flat tensor in sequence order,
    one flat q with rows only for the sequences that have one."""
    q = torch.softmax(torch.randn(3, 10), -1)
    drafts = Drafts.gather([([5, 6], None), (torch.tensor([7, 8, 3]), q), ([], None),
                            ([9], None)], CPU)
    assert drafts.offsets == [0, 2, 5, 5, 6] and drafts.num_tokens == 6
    assert drafts.token_ids.tolist() == [5, 6, 7, 8, 3, 9]
    assert drafts.host == [5, 6, UNKNOWN, UNKNOWN, UNKNOWN, 9]
    assert drafts.host_of(0) == [5, 6] and drafts.host_of(1) is None
    assert drafts.host_of(2) == [] and drafts.host_of(3) == [9]
    assert drafts.has_q == [False, True, False, False]
    assert drafts.draft_probs.shape == (6, 10) and torch.equal(drafts.draft_probs[2:5], q)
    host = Drafts.gather([([1], None), ([2, 3], None)], CPU)
    assert host.token_ids.tolist() == [1, 2, 3] and host.draft_probs is None


def test_input_ids_place_each_sequences_drafts_after_its_tokens():
    drafts = Drafts.gather([([5, 6], None), (torch.tensor([7]), None), ([], None)], CPU)
    items = [RunItem([1], 0, [0], 3), RunItem([2, 3], 0, [1], 2), RunItem([4], 0, [2], 1)]
    assert input_ids(items, drafts, CPU).tolist() == [[1, 5, 6, 2, 3, 7, 4]]
    # padded rows (static steps): each item at its own first row
    assert input_ids(items, drafts, CPU, lambda i: 4 * i, 12).tolist() == [
        [1, 5, 6, 0, 2, 3, 7, 0, 4, 0, 0, 0]]
    chained = Drafts([1, 1], torch.tensor([4, 2]))  # a draft model's chained forward
    assert input_ids([RunItem([], 5, [0], 1), RunItem([], 7, [1], 1)], chained,
                     CPU).tolist() == [[4, 2]]
    assert input_ids(items, None, CPU).tolist() == [[1, 2, 3, 4]]


def test_the_runner_plan_is_resolved_once_and_refuses_what_cannot_run():
    plan = RunnerPlan.resolve(EngineConfig(), CPU)
    assert plan.attention_backend == "sdpa" and not plan.static_steps and not plan.capture
    static = RunnerPlan.resolve(EngineConfig(attention_backend="triton", cuda_graphs="static"),
                                CPU)
    assert static.static_steps and not static.capture and static.tokens_per_seq == 1
    with pytest.raises(ValueError, match="cuda_graphs"):
        RunnerPlan.resolve(EngineConfig(attention_backend="sdpa", cuda_graphs="static"), CPU)
    with pytest.raises(ValueError, match="attention_kv_split"):
        RunnerPlan.resolve(EngineConfig(attention_backend="sdpa", attention_kv_split=64), CPU)


def test_a_row_after_device_held_drafts_is_keyed_by_its_position():
    seq = Sequence("r", [3, 4, 5], SamplingParams(temperature=0.8, seed=7))
    seq.token_ids += [6, 7]  # two generated tokens
    on_host = row_spec(seq, 2, [1, 2, 9])
    held = row_spec(seq, 2)  # the same position, the drafts' ids on the device only
    assert on_host.noise_key == held.noise_key == keys.noise_key(7, 4)
    assert on_host.output_token_ids == [6, 7, 1, 2] and held.output_token_ids == [6, 7]
    assert row_spec(seq, 0, None, draft_stream(False)).noise_key == keys.noise_key(7, 2,
                                                                                  keys.DRAFT)
    assert row_spec(seq, 0, None, draft_stream(True)).noise_key == keys.noise_key(7, 2)
    penalized = Sequence("p", [3], SamplingParams(frequency_penalty=0.5))
    with pytest.raises(AssertionError, match="on the host"):
        row_spec(penalized, 1)


def test_verified_by_pick_is_greedy_or_coupled_seeded_sampling():
    assert by_pick(SamplingParams(temperature=0), coupled=False)
    assert by_pick(SamplingParams(temperature=0.7, seed=1), coupled=True)
    assert not by_pick(SamplingParams(temperature=0.7, seed=1), coupled=False)
    assert not by_pick(SamplingParams(temperature=0.7), coupled=True)
