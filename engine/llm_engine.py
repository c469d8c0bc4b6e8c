"""LLMEngine: requests in, tokens out.

One `step()`: schedule -> ONE target forward (prompt chunks and 1 + k verification tokens
together) -> verify (exact rejection sampling; plain sampling is the k = 0 case) -> update
(commit, roll back rejected slots, stop checks) -> propose the next drafts.

Must not know about HTTP. The server drives `step()` from its own thread through a small client
class; offline users call `generate()`.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model_runner import ModelRunner, RunItem
from engine.sample import rejection_sampler, sampler
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
    num_drafted_tokens: int = 0  # speculation: draft tokens verified for this request
    num_accepted_tokens: int = 0  # ... and accepted


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model: torch.nn.Module | None = None,
                 tokenizer=None, draft_model: torch.nn.Module | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            from engine.models.loader import load_model

            model, tokenizer = load_model(config.model, config.dtype, config.device,
                                          config.gguf_file, config.tokenizer,
                                          config.model_cache_dir)
        self.tokenizer = tokenizer
        spec = config.speculative
        if spec.enabled and spec.method == "draft_model":
            owned = draft_model is None  # loaded here: nobody else holds it
            draft_model = self._prepare_draft(self._load_draft(model) if owned else draft_model,
                                              owned)
        models = [model] + ([draft_model] if spec.enabled and spec.method == "draft_model" else [])
        num_blocks = config.num_blocks or self._blocks_for_memory(models)
        self.runner = ModelRunner(model, num_blocks, config.block_size,
                                  cpu_matmul_autotune=config.cpu_matmul_autotune)
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
        self.speculator = self._build_speculator(models, num_blocks) if spec.enabled else None

    # -- setup helpers ---------------------------------------------------------------------
    def _load_draft(self, target: torch.nn.Module) -> torch.nn.Module:
        from engine.models.loader import load_model

        spec = self.config.speculative
        device = str(next(target.parameters()).device)
        draft, _ = load_model(spec.draft_model, spec.draft_dtype or self.config.dtype, device,
                              spec.draft_gguf_file, None, self.config.model_cache_dir)
        return draft

    def _prepare_draft(self, draft: torch.nn.Module, owned: bool) -> torch.nn.Module:
        """Optional weight-only int8 linears for the draft: exactness comes from the verifier.
        A caller's model (not `owned`) is never changed in place."""
        if self.config.speculative.draft_quantization != "int8":
            return draft
        if next(draft.parameters()).device.type != "cpu":
            raise ValueError("invalid speculative config draft_quantization: int8 runs on the "
                             "CPU only")
        import warnings

        from torch.ao.quantization import quantize_dynamic

        # dynamic int8 linears take fp32 activations
        if owned or draft.dtype == torch.float32:
            fp32, inplace = draft.float(), owned
        else:
            fp32, inplace = copy.deepcopy(draft).float(), True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks the quantized tensor API deprecated
            return quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8, inplace=inplace)

    def _blocks_for_memory(self, models: list[torch.nn.Module]) -> int:
        """Blocks that fit kv_cache_memory_gb; a draft model's KV shares the same block ids."""
        from engine.attention.paged import PagedKVCache
        from engine.model_runner import ModelShape

        per_block = 0
        for model in models:
            shape = ModelShape.of(model)
            per_block += PagedKVCache.bytes_per_block(shape.num_layers, self.config.block_size,
                                                      shape.num_kv_heads, shape.head_dim,
                                                      model.get_input_embeddings().weight.dtype)
        return max(1, int(self.config.kv_cache_memory_gb * (1 << 30) // per_block))

    def _build_speculator(self, models: list[torch.nn.Module], num_blocks: int):
        from engine.spec_decode.draft_model import DraftModelProposer
        from engine.spec_decode.ngram import NgramProposer
        from engine.spec_decode.speculator import Speculator

        spec = self.config.speculative
        if spec.method == "ngram":
            proposer = NgramProposer(spec.ngram_min_n, spec.ngram_max_n)
        else:
            tok_size = len(self.tokenizer) if self.tokenizer is not None else None
            proposer = DraftModelProposer(models[1], num_blocks, self.config.block_size,
                                          self.block_manager, self.vocab_size, tok_size,
                                          self.config.seed, self.config.cpu_matmul_autotune,
                                          spec.draft_stop_confidence)
        speculator = Speculator(spec, proposer, self.max_model_len)
        if spec.adaptive and spec.calibrate:
            self._calibrate(speculator)
        return speculator

    def _calibrate(self, speculator) -> None:
        """Seed the cost model: time target passes and draft forwards of n tokens (one
        sequence), and of 16 one-token sequences for the per-sequence cost."""
        from engine.sequence import Sequence
        from engine.spec_decode.speculator import (CALIBRATION_SEQS, CALIBRATION_TOKENS,
                                                   CALIBRATION_TOKENS_DRAFT)

        context = 64
        dummy = Sequence("__calibration__", [0] * context, SamplingParams())
        need = context + max(CALIBRATION_TOKENS + CALIBRATION_TOKENS_DRAFT)
        if not self.block_manager.allocate(dummy, need):
            return
        ctl = speculator.controller
        draft_runner = getattr(speculator.proposer, "runner", None)

        def timed(runner, items) -> float:  # a forward and a greedy pick from its logits, as
            return self._time(lambda: runner.execute(items).logits.argmax(-1).tolist())  # live

        try:
            for runner, sizes, table, seq_cost in (
                    (self.runner, CALIBRATION_TOKENS, ctl.target_cost, "target_seq_cost"),
                    (draft_runner, CALIBRATION_TOKENS_DRAFT, ctl.draft_cost, "draft_seq_cost")):
                if runner is None:
                    continue
                runner.execute([RunItem([0] * context, 0, dummy.block_table, 1)])  # warm-up
                for n in sizes:
                    table.record(n, timed(runner, [RunItem([0] * n, context, dummy.block_table,
                                                           n)]))
                one_token_seqs = [RunItem([0], context, dummy.block_table, 1)] * CALIBRATION_SEQS
                seconds = timed(runner, one_token_seqs)
                setattr(ctl, seq_cost,
                        max(seconds - table(CALIBRATION_SEQS), 0.0) / (CALIBRATION_SEQS - 1))
        finally:
            self.block_manager.free(dummy)

    def _time(self, fn, repeats: int = 2) -> float:
        best = float("inf")
        for _ in range(repeats):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what this engine cannot run (InvalidRequestError naming the field).

        Sampling ranges are checked when `params` is built; this adds what needs the model:
        token ids inside the vocabulary, and the prompt plus max_tokens inside the context.
        """
        vocab, context = self.vocab_size, self.max_model_len
        if not prompt_ids:
            raise InvalidRequestError("invalid prompt: it is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"invalid prompt: token ids must be in [0, {vocab})",
                                      "prompt")
        if len(prompt_ids) >= context:
            raise InvalidRequestError(
                f"invalid prompt: {len(prompt_ids)} tokens, but the context length is {context} "
                f"(prompt plus at least one new token)", "prompt", "context_length_exceeded")
        room = context - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"invalid max_tokens: {params.max_tokens}, but only {room} tokens fit after the "
                f"{len(prompt_ids)}-token prompt (context {context})", "max_tokens",
                "context_length_exceeded")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"invalid sampling parameter logit_bias: token ids must be "
                                      f"in [0, {vocab})", "logit_bias")

    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the bad field."""
        params = params or SamplingParams()
        prompt_ids = self._encode(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._sequences:
            raise InvalidRequestError(f"invalid request_id: {request_id!r} is already in flight",
                                      "request_id")
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
        if seq is None:
            return None
        if self.speculator:
            self.speculator.forget(seq, finished=True)
        return self._output(seq)

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
                raise InvalidRequestError("invalid prompt: text needs a tokenizer; pass token ids",
                                          "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        spec = self.speculator
        if spec:
            for seq in out.preempted:
                spec.forget(seq, finished=False)
        if out.is_empty:
            return []
        items = [RunItem(s.token_ids, s.start, s.seq.block_table, s.num_sample_rows)
                 for s in out.scheduled]
        t0 = time.perf_counter()
        step_logits = self.runner.execute(items)
        new_tokens, logprobs = self._verify(out, step_logits)
        if spec:  # the cost of a target pass includes verifying its drafts
            spec.record_target_step(out.num_batched_tokens, len(items),
                                    time.perf_counter() - t0)
        num_outputs = [s.seq.num_output_tokens for s in out.scheduled]
        changed = self.scheduler.update(out, new_tokens)
        for sched, before, lps in zip(out.scheduled, num_outputs, logprobs):
            if lps:  # keep the logprobs of the tokens actually committed
                seq = sched.seq
                seq.output_logprobs += lps[:seq.num_output_tokens - before]
        if spec:
            for seq in changed:
                if seq.is_finished:
                    spec.forget(seq, finished=True)
            room = self.config.max_num_seqs - len(self.scheduler.running)
            spec.propose(self.scheduler.running, self.config.max_num_batched_tokens,
                         self._row_spec, min(len(self.scheduler.waiting), max(room, 0)))
        return [self._output(seq) for seq in changed]

    def _row_spec(self, seq: Sequence, drafts: list[int]) -> sampler.RowSpec:
        """How to sample the position after `drafts` (the drafts count as generated tokens)."""
        history = seq.output_token_ids + drafts if drafts else seq.output_token_ids
        return sampler.RowSpec(seq.params, seq.prompt_token_ids, history,
                                self._seq_generators.get(seq.request_id))

    def _verify(self, out: SchedulerOutput, step_logits):
        """Tokens (and logprobs) per scheduled sequence: accepted drafts + one token.

        A sequence with k verified drafts owns k + 1 rows; k = 0 is plain sampling. Prompt
        chunks that do not reach the end of the prompt own no rows and get no tokens.
        """
        specs, owners, drafted = [], [], []
        for i, sched in enumerate(out.scheduled):
            lo, hi = step_logits.row_offsets[i], step_logits.row_offsets[i + 1]
            if hi == lo:
                continue
            seq, k = sched.seq, hi - lo - 1
            drafts = seq.draft_token_ids[:k]  # the budget may have cut the drafts short
            specs += [self._row_spec(seq, drafts[:j]) for j in range(k + 1)]
            owners.append((i, lo))
            drafted.append(drafts)
        new_tokens: list[list[int]] = [[] for _ in out.scheduled]
        logprobs: list[list] = [[] for _ in out.scheduled]
        if not specs:
            return new_tokens, logprobs
        raw = step_logits.logits  # [R, V]: exactly the rows of `specs`, in order
        tensors = sampler.build_sampling_tensors(specs, self.vocab_size, self.device)
        processed = sampler.process_logits(raw, tensors)
        if not any(drafted):  # no speculation this step: one vectorized draw
            emitted = [[t] for t in sampler.sample(processed, tensors, self.generator).tolist()]
        else:
            emitted = self._rejection_sample(out, owners, drafted, processed, tensors)
        rows, tokens, nums = [], [], []
        for (i, lo), toks, drafts in zip(owners, emitted, drafted):
            seq = out.scheduled[i].seq
            new_tokens[i] = toks
            if self.speculator:
                self.speculator.record(seq, len(drafts), len(toks) - 1)
            if seq.params.logprobs is not None:
                rows += range(lo, lo + len(toks))
                tokens += toks
                nums += [seq.params.logprobs] * len(toks)
        if rows:
            lps = sampler.logprobs_of(raw[rows], torch.tensor(tokens, device=raw.device), nums)
            it = iter(lps)
            for (i, _), toks in zip(owners, emitted):
                if out.scheduled[i].seq.params.logprobs is not None:
                    logprobs[i] = [next(it) for _ in toks]
        return new_tokens, logprobs

    def _rejection_sample(self, out, owners, drafted, processed, tensors) -> list[list[int]]:
        seqs = [out.scheduled[i].seq for i, _ in owners]
        greedy = [s.params.greedy for s in seqs]
        # greedy rows only need the argmax, which the processed logits already have
        target = processed if all(greedy) else torch.softmax(processed, dim=-1)
        qs = [self.speculator.draft_probs(s, len(d)) for s, d in zip(seqs, drafted)]
        draft_probs = None
        if any(q is not None for q, d in zip(qs, drafted) if d):
            # a greedy sequence's q is never read; one-hot keeps the rows aligned
            draft_probs = torch.cat([
                q if q is not None else torch.nn.functional.one_hot(
                    torch.tensor(d, device=self.device), self.vocab_size).float()
                for q, d in zip(qs, drafted) if d])
        flat = [t for d in drafted for t in d]
        emitted = rejection_sampler.rejection_sample(
            torch.tensor(flat, dtype=torch.long, device=self.device), [len(d) for d in drafted],
            draft_probs, target, greedy,
            [self._seq_generators.get(s.request_id) for s in seqs], self.generator)
        return rejection_sampler.to_lists(emitted)

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
            num_drafted_tokens=seq.num_drafted_tokens, num_accepted_tokens=seq.num_accepted_tokens,
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
