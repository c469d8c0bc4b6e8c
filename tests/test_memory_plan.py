"""The KV pool's size on CUDA: what the CUDA graphs and the largest step keep is accounted
before the pool is sized (engine/memory_plan.py). The arithmetic runs here; the measured
forwards run in tests/test_cuda.py."""

import logging

import pytest
import torch
from conftest import build_tiny_model

from engine import EngineConfig
from engine.memory_plan import GiB, graph_output_bytes, plan_kv_bytes, split_partial_bytes
from engine.model_runner import ModelRunner


def test_graph_outputs_are_one_buffer_of_the_largest_bucket():
    # buckets (1, 2, 4) sequences x 1..3 tokens share one output of 4 x 3 rows of logits
    assert graph_output_bytes((1, 2, 4), 3, 1000, 2) == 4 * 3 * 1000 * 2
    assert graph_output_bytes((), 3, 1000, 2) == 0


def test_split_partials_are_float32_max_sum_and_values_per_split():
    # 10 rows x 4 heads x 3 splits, each (max, sum, 64 values) in float32
    assert split_partial_bytes(10, 4, 64, 3) == 10 * 4 * 3 * (2 + 64) * 4


def test_the_pool_gets_what_is_asked_when_it_fits():
    plan = plan_kv_bytes(4 * GiB, total=80 * GiB, in_use=10 * GiB, utilization=0.9,
                         step_peak=2 * GiB, graphs=3 * GiB)
    assert plan.kv_bytes == 4 * GiB


def test_the_pool_shrinks_to_what_is_left_after_the_graphs(caplog):
    with caplog.at_level(logging.WARNING, "specserve.engine"):
        plan = plan_kv_bytes(60 * GiB, total=80 * GiB, in_use=10 * GiB, utilization=0.9,
                             step_peak=2 * GiB, graphs=3 * GiB)
    assert plan.kv_bytes == int(0.9 * 80 * GiB) - 15 * GiB
    assert "gpu_memory_utilization" in caplog.text and "CUDA graphs 3.00" in caplog.text


def test_no_room_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_bytes(GiB, total=16 * GiB, in_use=14 * GiB, utilization=0.9, step_peak=GiB,
                      graphs=GiB)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_utilization_is_validated(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_resize_kv_replaces_the_pool():
    runner = ModelRunner(build_tiny_model("qwen2", num_layers=1), 4, 16)
    runner.resize_kv(32)
    assert runner.kv.num_blocks == 32 and runner.kv.k[0].shape[0] == 33
    assert runner.kv.scratch_block == 32
    assert runner.kv.k[0].dtype == next(runner.model.parameters()).dtype == torch.float32
