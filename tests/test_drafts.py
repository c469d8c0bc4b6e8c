"""The step's drafts object, the runner plan and the row rules: small and CPU-only."""

import pytest
import torch

from engine.config import EngineConfig
from engine.runner_plan import RunnerPlan
from engine.sample import keys
from engine.sample.row_spec import by_pick, draft_stream, row_spec
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.drafts import Drafts

CPU = torch.device("cpu")


def test_drafts_are_flat_over_sequences_wherever_they_are_held():
    """Host drafts, device drafts and none, in one step: one flat tensor in sequence order."""
    drafts = Drafts([[5, 6], None, [], [9]], [None, torch.tensor([7, 8, 3]), None, None],
                    num_draft_tokens=[2, 3, 0, 1])
    assert drafts.offsets == [0, 2, 5, 5, 6] and drafts.num_tokens == 6
    assert drafts.held_by_device
    assert drafts.ids(CPU).tolist() == [5, 6, 7, 8, 3, 9]
    assert drafts.of(0) == [5, 6]
    host = Drafts([[1], [2, 3]])
    assert not host.held_by_device and host.ids(CPU).tolist() == [1, 2, 3]
    chained = Drafts.on_device(torch.tensor([4, 2]))
    assert chained.num_draft_tokens == [1, 1] and chained.ids(CPU).tolist() == [4, 2]


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
    on_host = row_spec(seq, [1, 2])
    held = row_spec(seq, 2)  # the same position, the drafts' ids on the device only
    assert on_host.noise_key == held.noise_key == keys.noise_key(7, 4)
    assert row_spec(seq, [], draft_stream(False)).noise_key == keys.noise_key(7, 2, keys.DRAFT)
    assert row_spec(seq, [], draft_stream(True)).noise_key == keys.noise_key(7, 2)


def test_verified_by_pick_is_greedy_or_coupled_seeded_sampling():
    assert by_pick(SamplingParams(temperature=0), coupled=False)
    assert by_pick(SamplingParams(temperature=0.7, seed=1), coupled=True)
    assert not by_pick(SamplingParams(temperature=0.7, seed=1), coupled=False)
    assert not by_pick(SamplingParams(temperature=0.7), coupled=True)
