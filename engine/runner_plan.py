"""How the model runners run on this device: resolved ONCE from the config, for both runners.

Must not hold a model or a tensor: it decides, and `ModelRunner` (engine/model_runner.py) does.
The target's runner and the draft model's are built from the same plan, so a decision (the
attention backend, split-KV, static buckets and CUDA graphs) is made in one place; only batch
invariance is the target's alone (the draft's numerics never change what is emitted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.memory_plan import static_tokens
from engine.model_runner import ModelRunner, resolve_attention_backend


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
                   tuple(config.cuda_graph_batch_sizes), static_tokens(config))

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
                                       self.capture)
