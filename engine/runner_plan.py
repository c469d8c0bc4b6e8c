"""How the model runners run on this device: resolved ONCE from the config, for both runners,
and the target's runner built from it, ready to step.

Must not hold a model or a tensor itself: it decides, and `ModelRunner` (engine/model_runner.py)
does. The target's runner and the draft model's are built from the same plan, so every
decision (the attention backend, split-KV, static buckets and CUDA graphs) is made here and
only here; only batch invariance is the target's alone (the draft's numerics never change what
is emitted). `build_target` states the target's construction order in code: tensor-parallel
workers, the runner on a pool, the head's capture, the pool sized to memory, static steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine import memory_plan
from engine.config import EngineConfig
from engine.model_runner import ModelRunner


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """auto: the Triton kernel on CUDA when Triton is installed, SDPA otherwise."""
    if name not in ("auto", "sdpa", "triton"):
        raise ValueError(f"invalid engine config attention_backend: {name!r}; "
                         f"use auto, sdpa or triton")
    from engine.attention import triton_backend

    if name == "triton" and device.type != "cuda" and not triton_backend.INTERPRETED:
        raise ValueError(f"attention_backend triton needs a CUDA model (this one is on "
                         f"{device.type}; on a CPU only Triton's interpreter runs it, "
                         f"TRITON_INTERPRET=1): use auto or sdpa")
    if name != "auto":
        return name

    return "triton" if device.type == "cuda" and triton_backend.available() else "sdpa"


class Target(NamedTuple):
    """The target's runner, ready to step, and what its pool allows."""

    runner: ModelRunner
    num_blocks: int  # the KV pool's blocks (every rank's, and the draft's and head's ids)
    max_model_len: int  # the context length: the config's or the model's, within the pool


@dataclass(frozen=True)
class RunnerPlan:
    device: torch.device
    attention_backend: str  # sdpa | triton (auto resolved for the device)
    attention_kv_split: int  # the triton backend's keys per split (0: off)
    batch_invariant: bool  # the target's forward follows engine/kernels/batch_invariant.py
    cpu_matmul_autotune: bool  # measured few-row matmul forms (where not batch-invariant)
    static_steps: bool  # short steps run in padded static buckets (engine/static_steps.py)
    capture: bool  # ... captured as CUDA graphs
    batch_sizes: tuple[int, ...]  # the buckets' sequences
    tokens_per_seq: int  # the largest bucket's tokens per sequence: 1 + k_max
    tree_tokens: int = 0  # the largest token-tree step's rows per sequence (0: no trees)

    @classmethod
    def resolve(cls, config: EngineConfig, device: torch.device) -> "RunnerPlan":
        """The plan for models on `device`; refuses settings that cannot go together."""
        backend = resolve_attention_backend(config.attention_backend, device)
        if config.attention_kv_split and backend != "triton":
            raise ValueError(f"invalid engine config attention_kv_split: "
                             f"{config.attention_kv_split} needs attention_backend triton "
                             f"(this runner uses {backend})")
        mode = config.cuda_graphs
        capture = mode == "auto" and device.type == "cuda"
        static = mode == "static" or capture
        if static and config.tensor_parallel_size > 1:
            if mode == "static":
                raise ValueError("invalid engine config cuda_graphs: static steps do not run "
                                 "with tensor_parallel_size > 1 (use auto or off)")
            static = capture = False  # split forwards run eagerly
        if static and backend != "triton":
            if mode == "static":
                raise ValueError("invalid engine config cuda_graphs: static steps need "
                                 "attention_backend triton")
            static = capture = False  # auto on CUDA without triton: eager
        return cls(device, backend, config.attention_kv_split, config.batch_invariant,
                   config.cpu_matmul_autotune, static, capture,
                   tuple(config.cuda_graph_batch_sizes), memory_plan.static_tokens(config),
                   memory_plan.static_tree_tokens(config))

    def runner(self, model: torch.nn.Module, num_blocks: int, block_size: int,
               target: bool = True) -> ModelRunner:
        """A runner for `model` (the target's, or a draft model's: not batch-invariant)."""
        return ModelRunner(model, num_blocks, block_size,
                           cpu_matmul_autotune=self.cpu_matmul_autotune,
                           batch_invariant=self.batch_invariant and target,
                           attention_backend=self.attention_backend,
                           attention_kv_split=self.attention_kv_split)

    def enable_static_steps(self, runner: ModelRunner, max_model_len: int) -> None:
        """Padded static steps (captured as CUDA graphs) for `runner`, where the plan has them."""
        if self.static_steps:
            runner.enable_static_steps(self.batch_sizes, self.tokens_per_seq, max_model_len,
                                       self.capture, self.tree_tokens)

    def build_target(self, config: EngineConfig, model: torch.nn.Module,
                     whole: torch.nn.Module | None, models: list[torch.nn.Module],
                     heads: tuple = ()) -> Target:
        """The target's runner for `model` (rank 0's share with tensor parallelism; `whole`:
        the model the caller gave, whose shares the other ranks take, or None), ready:
        1. the other tensor-parallel ranks started and loaded (`runner.workers`);
        2. every rank's runner on a pool: the configured or memory-sized blocks, or on CUDA a
           small pool to measure forwards on;
        3. the layers a draft head reads captured (before the measured forwards);
        4. on CUDA the pool sized from those forwards (engine/memory_plan.py), every rank's;
        5. static steps (and CUDA graphs) over the final pool.
        models: the target and a draft model (their KV share the block ids); heads: a draft
        head's. On a failure the workers started are stopped."""
        workers = _start_workers(config, whole, model)
        try:
            num_blocks = config.num_blocks or memory_plan.blocks_for_memory(config, models,
                                                                            heads)
            measure = config.num_blocks is None and self.device.type == "cuda"
            runner = self._rank_runners(config, model, workers, memory_plan.profile_blocks(
                config) if measure else num_blocks)
            if heads:  # before the measured forwards: they return the features too
                runner.enable_capture(heads[0].config.layers)
            if measure:
                num_blocks = memory_plan.plan_blocks(config, runner, models, heads,
                                                     self.capture)
                runner.resize_kv(num_blocks)
                if workers is not None:
                    workers.resize_kv(num_blocks, runner.kv_bytes)
            if workers is not None:
                memory_plan.log_ranks(workers.ranks())
            max_model_len = memory_plan.max_model_len(config, model, num_blocks)
            self.enable_static_steps(runner, max_model_len)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        return Target(runner, num_blocks, max_model_len)

    def _rank_runners(self, config: EngineConfig, model: torch.nn.Module, workers,
                      num_blocks: int) -> ModelRunner:
        """Rank 0's runner on a pool of `num_blocks`; with tensor parallelism every rank builds
        its own (measuring its kernels' invariance at the same time) and rank 0's runs each
        forward with them."""
        if workers is None:
            return self.runner(model, num_blocks, config.block_size)
        workers.start_runners(self, num_blocks)
        runner = self.runner(model, num_blocks, config.block_size)
        runner.join_group(workers.group, workers)
        workers.wait_runners(runner.kv_bytes)
        return runner


def _start_workers(config: EngineConfig, whole: torch.nn.Module | None,
                   model: torch.nn.Module):
    """Tensor parallelism: ranks 1..N-1 started, joined and loaded (rank 0's share is
    `model`); None for one rank. The engine stops them when it closes (or is collected)."""
    if config.tensor_parallel_size == 1:
        return None
    from engine.parallel.workers import Workers, model_bytes

    if whole is not None and next(whole.parameters()).device.type != "cpu":
        raise ValueError("with tensor_parallel_size > 1, give the engine the whole target "
                         "on the host: each rank moves its share to its own device")
    workers = Workers(config, whole, next(model.parameters()).device)
    try:
        workers.wait_loaded(model_bytes(model))
    except BaseException:
        workers.close()
        raise
    return workers
