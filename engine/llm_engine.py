"""LLMEngine: requests in, tokens out. One `step()` = schedule -> one forward -> sample -> update.

Must not know about HTTP. The server drives `step()` from its own thread through a small client
class; offline users call `generate()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.sample import sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    new_token_ids: list[int]  # generated in this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per output token
    text: str | None = None  # filled by generate() when a tokenizer is present
    metrics: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model: torch.nn.Module | None = None,
                 tokenizer=None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            from engine.models.loader import load_model

            model, tokenizer = load_model(config.model, config.dtype, config.device,
                                          config.gguf_file, config.tokenizer,
                                          config.model_cache_dir)
        self.tokenizer = tokenizer
        num_blocks = config.num_blocks or self._blocks_for_memory(model)
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.vocab_size = self.runner.shape.vocab_size
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(model, num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            self.max_model_len),
            self.block_manager, self._eos_token_ids(model, tokenizer))
        self.device = self.runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._seq_generators: dict[str, torch.Generator] = {}
        self._sequences: dict[str, Sequence] = {}
        self._num_emitted: dict[str, int] = {}
        self._ids = itertools.count()

    # -- setup helpers ---------------------------------------------------------------------
    def _blocks_for_memory(self, model: torch.nn.Module) -> int:
        from engine.attention.paged import PagedKVCache
        from engine.model_runner import ModelShape

        shape = ModelShape.of(model)
        per_block = PagedKVCache.bytes_per_block(shape.num_layers, self.config.block_size,
                                                 shape.num_kv_heads, shape.head_dim,
                                                 next(model.parameters()).dtype)
        return max(1, int(self.config.kv_cache_memory_gb * (1 << 30) // per_block))

    def _max_model_len(self, model: torch.nn.Module, num_blocks: int) -> int:
        model_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        limit = self.config.max_model_len or model_len or num_blocks * self.config.block_size
        # One sequence must always fit in the pool, or preemption could never make room.
        return min(limit, num_blocks * self.config.block_size)

    @staticmethod
    def _eos_token_ids(model: torch.nn.Module, tokenizer) -> set[int]:
        ids: set[int] = set()
        gen = getattr(model, "generation_config", None)
        for value in (getattr(gen, "eos_token_id", None),
                      getattr(tokenizer, "eos_token_id", None) if tokenizer else None):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return ids

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming the bad field."""
        params = params or SamplingParams()
        prompt_ids = self._encode(prompt)
        if not prompt_ids:
            raise ValueError("invalid prompt: it is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"invalid prompt: token ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"invalid prompt: {len(prompt_ids)} tokens, but the context length "
                             f"is {self.max_model_len} (prompt plus at least one new token)")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"invalid sampling parameter logit_bias: token ids must be in "
                             f"[0, {self.vocab_size})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._sequences:
            raise ValueError(f"invalid request_id: {request_id!r} is already in flight")
        seq = Sequence(request_id, prompt_ids, params)
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._seq_generators[request_id] = gen
        self._sequences[request_id] = seq
        self._num_emitted[request_id] = 0
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return self._output(seq) if seq else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("invalid prompt: text needs a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        step_logits = self.runner.execute(out.scheduled)
        new_tokens = self._sample(out, step_logits)
        changed = self.scheduler.update(out, new_tokens)
        return [self._output(seq) for seq in changed]

    def _sample(self, out: SchedulerOutput, step_logits) -> list[list[int]]:
        """One token per sequence whose scheduled tokens reach its end; none for prompt chunks."""
        rows, owners = [], []
        for i, sched in enumerate(out.scheduled):
            lo, hi = step_logits.row_offsets[i], step_logits.row_offsets[i + 1]
            if hi == lo:
                continue
            seq = sched.seq
            rows.append(sampler.RowSpec(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                        self._seq_generators.get(seq.request_id)))
            owners.append((i, hi - 1))
        new_tokens: list[list[int]] = [[] for _ in out.scheduled]
        if not rows:
            return new_tokens
        raw = step_logits.logits[[row for _, row in owners]]  # [R, V]
        tensors = sampler.build_sampling_tensors(rows, self.vocab_size, self.device)
        token_ids = sampler.sample(sampler.process_logits(raw, tensors), tensors, self.generator)
        logprobs = sampler.logprobs_of(raw, token_ids, [r.params.logprobs for r in rows])
        for (i, _), token, lp in zip(owners, token_ids.tolist(), logprobs):
            new_tokens[i] = [token]
            if lp is not None:
                out.scheduled[i].seq.output_logprobs.append(lp)
        return new_tokens

    def _output(self, seq: Sequence) -> RequestOutput:
        rid = seq.request_id
        emitted = self._num_emitted.get(rid, 0)
        outputs = seq.output_token_ids
        self._num_emitted[rid] = len(outputs)
        result = RequestOutput(
            request_id=rid, prompt_token_ids=seq.prompt_token_ids, output_token_ids=outputs,
            new_token_ids=outputs[emitted:], finished=seq.is_finished,
            finish_reason=seq.finish_reason, num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            metrics={"arrival_time": seq.arrival_time,
                     "first_scheduled_time": seq.first_scheduled_time or 0.0,
                     "first_token_time": seq.first_token_time or 0.0,
                     "num_preemptions": seq.num_preemptions})
        if seq.is_finished:
            self._sequences.pop(rid, None)
            self._seq_generators.pop(rid, None)
            self._num_emitted.pop(rid, None)
        return result

    # -- offline API -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int] | str],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion (all in flight at once); outputs in prompt order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("generate: one SamplingParams per prompt, or a single one")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            outputs = self.step()
            if not outputs and not self.scheduler.running and self.scheduler.waiting:
                raise RuntimeError("the scheduler cannot admit any waiting request")
            for output in outputs:
                if output.finished:
                    final[output.request_id] = output
        results = [final[i] for i in ids]
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        return results
