"""LLMEngine: requests in, tokens out.

One `step()`: schedule -> ONE target forward (prompt chunks and 1 + k verification tokens
together) -> verify (exact rejection sampling; plain sampling is the k = 0 case) -> update
(commit, roll back rejected slots, stop checks) -> propose the next drafts.

Must not know about HTTP. The server drives `step()` from its own thread through a small client
class; offline users call `generate()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine import device_io, memory_plan
from engine.attention.paged import PagedKVCache
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, StepError
from engine.memory_plan import GiB
from engine.model_runner import DeviceTokens, ModelRunner, ModelShape, RunItem, StepLogits
from engine.models.draft import draft_source, draft_vocabulary, load_draft, prepare_draft
from engine.models.loader import load_model, resolve_model_path
from engine.models.quantize import apply_quantization
from engine.sample import keys, rejection_sampler, sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.speculator import build_speculator
from engine.structured import Grammars

log = logging.getLogger("specserve.engine")


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
    # per speculation method ("draft_model", "suffix", "ngram"): (drafted, accepted)
    spec_methods: dict[str, tuple[int, int]] = field(default_factory=dict)


class RowOwner(NamedTuple):
    """A scheduled sequence that owns logits rows this step: the row of its last committed
    token, then one row per draft it verifies (k = len(drafts), 0 for plain sampling)."""

    index: int  # in SchedulerOutput.scheduled
    seq: Sequence
    first_row: int
    drafts: list[int]  # placeholders where `device` holds them
    device: torch.Tensor | None = None  # [k] the drafts, when only the device holds them


class GrammarMasks(NamedTuple):
    rows: list[int]  # the step's constrained rows
    allowed: Future  # -> [len(rows), V] bool


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model: torch.nn.Module | None = None,
                 tokenizer=None, draft_model: torch.nn.Module | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        owned = model is None
        if owned:
            model, tokenizer = load_model(
                config.model, dtype=config.dtype, device=config.device,
                gguf_file=config.gguf_file, tokenizer=config.tokenizer,
                cache_dir=config.model_cache_dir)
        model = apply_quantization(
            model, config.quantization,
            resolve_model_path(config.model, config.model_cache_dir) if owned else None, owned,
            what="target", int4_kernel=config.int4_kernel)
        self.tokenizer = tokenizer
        draft_model = self._draft_model(model, draft_model)
        models = [model] + ([draft_model] if draft_model is not None else [])
        num_blocks = config.num_blocks or self._blocks_for_memory(models)
        # on CUDA the pool is sized after measuring forwards on a small one (memory_plan.py)
        plan = config.num_blocks is None and next(model.parameters()).device.type == "cuda"
        self.runner = ModelRunner(model, self._profile_blocks() if plan else num_blocks,
                                  config.block_size,
                                  cpu_matmul_autotune=config.cpu_matmul_autotune,
                                  batch_invariant=config.batch_invariant,
                                  attention_backend=config.attention_backend,
                                  attention_kv_split=config.attention_kv_split)
        if plan:
            num_blocks = self._plan_memory(models)
            self.runner.resize_kv(num_blocks)
        self.vocab_size = self.runner.shape.vocab_size
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(model, num_blocks)
        self._static_steps(self.runner)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len),
            self.block_manager, self._eos_token_ids(model, tokenizer))
        self.device = self.runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # the target pass's time for adaptive k: CUDA events on CUDA (drafts queued before
        # the step are not its time), the host clock elsewhere
        self._marks = device_io.Marks(self.device)
        self.coupled = config.speculative.verification == "coupled"
        self._sequences: dict[str, Sequence] = {}
        self._num_emitted: dict[str, int] = {}
        self._ids = itertools.count()
        tokenizer_size = len(tokenizer) if tokenizer is not None else None
        self.speculator = build_speculator(
            config, self.runner, self.block_manager, draft_model, tokenizer_size,
            self.max_model_len, self._static_steps,
            draft_vocabulary(tokenizer, config.speculative.draft_vocab_size,
                             tokenizer_size or self.vocab_size))
        self._grammars: Grammars | None = None  # built with the first grammar request
        self._mask_thread: ThreadPoolExecutor | None = None
        self.num_grammar_requests = 0

    @property
    def grammars(self) -> Grammars:
        """Structured output's tokenizer view and matchers (needs the tokenizer)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer",
                                          "grammar")
            self._grammars = Grammars(self.tokenizer, self.vocab_size,
                                      self.scheduler.eos_token_ids)
        return self._grammars

    @property
    def grammar_mask_seconds(self) -> float:
        """Time spent computing grammar masks so far."""
        return 0.0 if self._grammars is None else self._grammars.mask_seconds

    # -- setup helpers ---------------------------------------------------------------------
    def _draft_model(self, target: torch.nn.Module,
                     given: torch.nn.Module | None) -> torch.nn.Module | None:
        """The draft model speculation needs (loaded here unless `given`), or None."""
        speculative = self.config.speculative
        if not speculative.uses_draft_model:
            return None
        owned = given is None  # loaded here: nobody else holds it
        draft = load_draft(speculative, target, self.config.dtype,
                           self.config.model_cache_dir) if owned else given
        return prepare_draft(draft, speculative.draft_quantization, owned,
                             draft_source(speculative, self.config.model_cache_dir)
                             if owned else None, int4_kernel=self.config.int4_kernel,
                             private=speculative.draft_vocab_size > 0)

    def _bytes_per_block(self, models: list[torch.nn.Module]) -> int:
        """KV bytes of one block id: a draft model's KV shares the same block ids."""
        per_block = 0
        for model in models:
            shape = ModelShape.of(model)
            per_block += PagedKVCache.bytes_per_block(shape.num_layers, self.config.block_size,
                                                      shape.num_kv_heads, shape.head_dim,
                                                      model.get_input_embeddings().weight.dtype)
        return per_block

    def _blocks_for_memory(self, models: list[torch.nn.Module]) -> int:
        """Blocks that fit kv_cache_memory_gb."""
        return max(1, int(self.config.kv_cache_memory_gb * GiB // self._bytes_per_block(models)))

    def _static_tokens(self) -> int:
        """Tokens per sequence of the largest static bucket: 1 + k_max."""
        spec = self.config.speculative
        return 1 + (spec.k_max if spec.enabled else 0)

    def _profile_blocks(self) -> int:
        """A pool just large enough for the forwards `_plan_memory` measures."""
        tokens = max(self.config.max_num_batched_tokens, self._static_tokens())
        return -(-tokens // self.config.block_size) + 1

    def _plan_memory(self, models: list[torch.nn.Module]) -> int:
        """CUDA: the pool's blocks once weights, the largest step and the CUDA graphs are
        accounted (engine/memory_plan.py)."""
        cfg, runner, device = self.config, self.runner, self.runner.device
        tokens = self._static_tokens()
        captured = cfg.cuda_graphs == "auto" and runner.attention_backend == "triton"
        sizes = tuple(cfg.cuda_graph_batch_sizes) if captured else ()
        chunk_peak, bucket_peak = memory_plan.measure_step_peak(
            runner, cfg.max_num_batched_tokens, max(sizes, default=cfg.max_num_seqs), tokens,
            list(range(runner.kv.num_blocks)))
        graphs = sum(memory_plan.graph_output_bytes(
            sizes, tokens, ModelShape.of(m).vocab_size,
            m.get_input_embeddings().weight.element_size()) for m in models)
        graphs += bucket_peak * len(models) if captured else 0  # each runner's graph pool
        if cfg.attention_kv_split:  # split partials at the longest context (the measured
            # steps have no generated rows): an eager chunk of generated rows (a preemption's
            # recompute) and, kept by the graph pools, each runner's largest bucket
            pool_tokens = (int(cfg.kv_cache_memory_gb * GiB) // self._bytes_per_block(models)
                           * cfg.block_size)  # the KV pool bounds max_model_len (<= requested)
            longest = min(self._max_model_len(models[0], 1 << 40), pool_tokens)
            most = -(-longest // cfg.attention_kv_split)
            shapes = [(m.config.get_text_config().num_attention_heads, ModelShape.of(m).head_dim)
                      for m in models]
            chunk_peak += max(memory_plan.split_partial_bytes(cfg.max_num_batched_tokens, h, d,
                                                              most) for h, d in shapes)
            if captured:
                graphs += sum(memory_plan.split_partial_bytes(max(sizes) * tokens, h, d, most)
                              for h, d in shapes)
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        profile_kv = runner.kv.num_blocks * self._bytes_per_block([models[0]])
        in_use = total - free - cached - profile_kv
        plan = memory_plan.plan_kv_bytes(int(cfg.kv_cache_memory_gb * GiB), total, in_use,
                                         cfg.gpu_memory_utilization,
                                         max(chunk_peak, bucket_peak), graphs)
        log.info("memory plan: %s", plan.describe())
        return max(1, plan.kv_bytes // self._bytes_per_block(models))

    def _static_steps(self, runner: ModelRunner) -> None:
        """Padded static steps (captured as CUDA graphs) for `runner`, as `cuda_graphs` says."""
        mode = self.config.cuda_graphs
        capture = mode == "auto" and runner.device.type == "cuda"
        if mode == "off" or (mode == "auto" and not capture):
            return
        if runner.attention_backend != "triton":
            if mode == "static":
                raise ValueError("invalid engine config cuda_graphs: static steps need "
                                 "attention_backend triton")
            return  # auto on CUDA without triton: eager
        spec = self.config.speculative
        tokens = 1 + (spec.k_max if spec.enabled else 0)
        runner.enable_static_steps(tuple(self.config.cuda_graph_batch_sizes), tokens,
                                   self.max_model_len, capture)

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
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})",
                                      "prompt")
        if len(prompt_ids) >= context:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the context length is {context} "
                f"(the prompt plus at least one new token)", "prompt", "context_length_exceeded")
        room = context - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens is {params.max_tokens}, but only {room} tokens fit after the "
                f"{len(prompt_ids)}-token prompt (context {context})", "max_tokens",
                "context_length_exceeded")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the bad field.

        `cache_salt` partitions the prefix cache: only requests with an equal salt (None
        included) share cached blocks."""
        params = params or SamplingParams()
        prompt_ids = self._encode(prompt)
        self.validate(prompt_ids, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("invalid cache_salt: must be a string", "cache_salt")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._sequences:
            raise InvalidRequestError(f"invalid request_id: {request_id!r} is already in flight",
                                      "request_id")
        seq = Sequence(request_id, prompt_ids, params, cache_salt=cache_salt)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
            self.num_grammar_requests += 1
        self._sequences[request_id] = seq
        self._num_emitted[request_id] = 0
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self.speculator.drop([seq], finished=True)
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
        """Schedule, run, verify, update, propose.

        If anything in it raises, the requests it touched are aborted and StepError names them
        (engine/errors.py); the others stay queued when the engine's state is still intact."""
        self._touched = list(self.scheduler.running)  # until the schedule says who runs
        try:
            return self._step()
        except Exception as exc:
            raise self._fail_step() from exc

    def _fail_step(self) -> StepError:
        """Abort the requests a failed step touched; say whether the rest can go on."""
        ids = [seq.request_id for seq in self._touched if not seq.is_finished]
        for rid in ids:
            try:
                self.abort(rid)
            except Exception:  # noqa: BLE001 - state too broken to abort: reported as lost
                log.exception("request %s: abort after a failed step failed", rid)
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        intact = self.block_manager.consistent(live) and device_io.healthy(self.device)
        return StepError(ids, intact)

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self._touched = [s.seq for s in out.scheduled]
        self.speculator.drop(out.preempted, finished=False)
        if out.is_empty:
            return []
        started = self._marks.mark()
        masks = self._grammar_masks(out)  # computed while the target runs
        on_device = {}  # scheduled index -> its drafts, held by the device only
        for i, s in enumerate(out.scheduled):
            d = self.speculator.pop_device_drafts(s.seq)
            if d is not None:
                on_device[i] = d
        step_logits = self.runner.execute(
            [RunItem(s.token_ids, s.start, s.seq.block_table, s.num_sample_rows,
                     s.seq.num_prompt_tokens) for s in out.scheduled],
            self._device_tokens(out, on_device))
        owners = self._row_owners(out, step_logits, on_device)
        emitted, logprobs, ended = self._results(owners, step_logits.logits, masks)
        # a step without rows reads nothing back: on CUDA its time is then unknown
        seconds = (self._marks.seconds(started, ended) if ended is not None else
                   None if self._marks.cuda else self._marks.seconds(started, time.perf_counter()))
        self.speculator.observe(out.num_batched_tokens, len(out.scheduled), seconds,
                                ((o.seq, len(o.drafts), len(e) - 1)
                                 for o, e in zip(owners, emitted)))
        changed = self._update(out, owners, emitted, logprobs)
        self._touched = list(self.scheduler.running)  # proposing drafts touches every one
        self.speculator.propose(self.scheduler.running, self._num_joining(),
                                self._draft_row_spec)
        return [self._output(seq) for seq in changed]

    def _device_tokens(self, out: SchedulerOutput,
                       on_device: dict[int, torch.Tensor]) -> DeviceTokens | None:
        """Where the step's drafts held by the device only go among its new tokens."""
        if not on_device:
            return None
        index, values, at = [], [], 0
        for i, s in enumerate(out.scheduled):
            n = s.seq.num_tokens
            if i in on_device and s.end > n:  # drafts lo..hi - 1 are in this chunk
                lo, hi = max(s.start - n, 0), s.end - n
                index += range(at + n + lo - s.start, at + n + hi - s.start)
                values.append(on_device[i][lo:hi])
            at += s.num_new_tokens
        return DeviceTokens(index, torch.cat(values)) if values else None

    def _row_owners(self, out: SchedulerOutput, step_logits: StepLogits,
                    on_device: dict[int, torch.Tensor]) -> list[RowOwner]:
        """The scheduled sequences that own logits rows this step, with the drafts they verify.

        A sequence with k verified drafts owns k + 1 rows; k = 0 is plain sampling. Prompt
        chunks that do not reach the end of the prompt own no rows and get no tokens.
        """
        owners = []
        for i, sched in enumerate(out.scheduled):
            lo, hi = step_logits.row_offsets[i], step_logits.row_offsets[i + 1]
            if hi > lo:  # the budget may have cut the drafts short
                k = hi - lo - 1
                device = on_device.get(i)
                owners.append(RowOwner(i, sched.seq, lo, sched.seq.draft_token_ids[:k],
                                       None if device is None or not k else device[:k]))
        return owners

    def _grammar_masks(self, out: SchedulerOutput) -> GrammarMasks | None:
        """Start computing the grammar masks of this step's constrained rows (the last
        committed token and each draft of a sequence with a grammar) in a thread: llguidance
        releases the GIL, so they overlap the target's forward."""
        rows, index, row = [], [], 0
        for s in out.scheduled:
            n = s.num_sample_rows
            if n and s.seq.matcher is not None:
                rows += [(s.seq.matcher, s.seq.draft_token_ids[:j]) for j in range(n)]
                index += range(row, row + n)
            row += n
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return GrammarMasks(index, self._mask_thread.submit(self.grammars.allowed, rows,
                                                            self.device))

    def _row_spec(self, seq: Sequence, drafts: list[int],
                  stream: int = keys.RACE) -> sampler.RowSpec:
        """How to sample the position after `drafts` (the drafts count as generated tokens);
        a seeded request's noise there is keyed by (seed, position, stream)."""
        history = seq.output_token_ids + drafts if drafts else seq.output_token_ids
        seed = seq.params.seed
        key = None if seed is None else keys.noise_key(seed, len(history), stream)
        grammar = (None if seq.matcher is None else
                   sampler.GrammarRow(self._grammars, seq.matcher, list(drafts)))
        return sampler.RowSpec(seq.params, seq.prompt_token_ids, history, key, grammar)

    def _draft_row_spec(self, seq: Sequence, drafts: list[int]) -> sampler.RowSpec:
        """What a draft model samples from: under coupled verification a seeded request drafts
        with the target's own keyed noise (so the draft picks what the target would when the
        two agree); otherwise with a stream of its own."""
        return self._row_spec(seq, drafts, keys.RACE if self.coupled else keys.DRAFT)

    def _by_pick(self, seq: Sequence) -> bool:
        """Verified by the target's own pick: greedy, or seeded sampling under coupled
        verification (both emit exactly the tokens plain decoding would)."""
        return seq.params.greedy or (self.coupled and seq.params.seed is not None)

    def _results(self, owners: list[RowOwner], logits: torch.Tensor,
                 masks: GrammarMasks | None
                 ) -> tuple[list[list[int]], list[list | None], object]:
        """Per row owner, its emitted tokens (accepted drafts + one sampled token) and their
        logprobs (None unless asked for), and the mark of the step's end on the device (None
        without owners). Verification and logprobs run on the device; the host reads them in
        the step's ONE transfer (engine/device_io.py)."""
        if not owners:
            return [], [], None
        emitted = self._verify(owners, logits, masks)
        lp = self._logprob_tensors(owners, emitted, logits)
        ended = self._marks.mark()
        host = device_io.lists(emitted, *(lp or (None, None, None)))
        tokens = rejection_sampler.to_lists(host[0])
        return tokens, self._logprobs(owners, tokens, host[1:]), ended

    def _verify(self, owners: list[RowOwner], logits: torch.Tensor,
                masks: GrammarMasks | None = None) -> torch.Tensor:
        """[B, max k + 1] on the device: per row owner its emitted tokens, padded with
        PLACEHOLDER.

        logits: [R, V] raw, exactly the owners' rows in order; masks: of its constrained rows.
        """
        rows = [self._row_spec(o.seq, o.drafts[:j]) for o in owners
                for j in range(len(o.drafts) + 1)]
        allowed = None if masks is None else (masks.rows, masks.allowed.result())
        tensors = sampler.build_sampling_tensors(rows, self.vocab_size, self.device, allowed)
        processed = sampler.process_logits(logits, tensors)
        if not any(o.drafts for o in owners):  # no speculation this step: one vectorized draw
            return sampler.sample(processed, tensors, self.generator)[:, None]
        return self._verify_drafts(owners, processed, tensors)

    def _verify_drafts(self, owners: list[RowOwner], processed: torch.Tensor,
                       tensors: sampler.SamplingTensors) -> torch.Tensor:
        by_pick = [self._by_pick(o.seq) for o in owners]
        # the target's own pick at every row verified by pick: a keyed race for coupled
        # sampled rows, the argmax for the rest (never read for rows verified by rejection)
        race = [pick and not o.seq.params.greedy
                for o, pick in zip(owners, by_pick) for _ in range(len(o.drafts) + 1)]
        picks = sampler.sample(processed, tensors, race=race)
        # rows verified by pick only need their picks, which the processed logits already gave
        target = processed if all(by_pick) else torch.softmax(processed, dim=-1)
        qs = [self.speculator.draft_probs(o.seq, len(o.drafts)) for o in owners]
        qs = [None if pick else q for q, pick in zip(qs, by_pick)]  # by pick: q is not needed
        flat = device_io.to_device([t for o in owners for t in o.drafts], torch.long,
                                   self.device)
        index, values, start = [], [], 0
        for o in owners:  # drafts that only the device holds
            if o.device is not None:
                index += range(start, start + len(o.drafts))
                values.append(o.device)
            start += len(o.drafts)
        if values:
            flat.index_copy_(0, device_io.to_device(index, torch.long, self.device),
                             torch.cat(values))
        draft_probs = None
        if any(q is not None for q, o in zip(qs, owners) if o.drafts):
            # a q that is never read (verified by pick) or absent: one-hot keeps rows aligned
            parts, start = [], 0
            for q, o in zip(qs, owners):
                if o.drafts:
                    parts.append(q if q is not None else torch.nn.functional.one_hot(
                        flat[start:start + len(o.drafts)], self.vocab_size).float())
                start += len(o.drafts)
            draft_probs = torch.cat(parts)
        noise_keys = [None if pick or o.seq.params.seed is None else
                      tensors.noise_keys[o.first_row:o.first_row + len(o.drafts) + 1]
                      for o, pick in zip(owners, by_pick)]
        return rejection_sampler.rejection_sample(
            flat, [len(o.drafts) for o in owners], draft_probs, target, by_pick, noise_keys,
            self.generator, picks)

    def _logprob_tensors(self, owners: list[RowOwner], emitted: torch.Tensor,
                         logits: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """On the device, the logprobs at every row of the owners that asked for them, of the
        token emitted there (rows after the last emitted token are computed and dropped)."""
        rows, at_owner, at_index, top = [], [], [], 0
        for b, o in enumerate(owners):
            if o.seq.params.logprobs is not None:
                n = len(o.drafts) + 1
                rows += range(o.first_row, o.first_row + n)
                at_owner += [b] * n
                at_index += range(n)
                top = max(top, o.seq.params.logprobs)
        if not rows:
            return None
        index = device_io.to_device([rows, at_owner, at_index], torch.long, self.device)
        tokens = emitted[index[1], index[2]].clamp(min=0)  # PLACEHOLDER rows: dropped later
        return sampler.logprob_tensors(logits[index[0]], tokens, top)

    def _logprobs(self, owners: list[RowOwner], emitted: list[list[int]],
                  host: list) -> list[list | None]:
        """Per row owner, the logprobs of its emitted tokens (None unless it asked for them),
        from the host lists of `_logprob_tensors`."""
        if host[0] is None:
            return [None] * len(owners)
        chosen, vals, ids = host
        result: list[list | None] = []
        at = 0  # the owner's first row in the host lists
        for o, toks in zip(owners, emitted):
            n = o.seq.params.logprobs
            if n is None:
                result.append(None)
                continue
            m = len(toks)
            result.append(sampler.logprob_entries(chosen[at:at + m], vals[at:at + m],
                                                  ids[at:at + m], [n] * m))
            at += len(o.drafts) + 1
        return result

    def _update(self, out: SchedulerOutput, owners: list[RowOwner], emitted: list[list[int]],
                logprobs: list[list | None]) -> list[Sequence]:
        """Commit the emitted tokens with their logprobs (the scheduler rolls back rejected
        slots and stops sequences); returns the sequences that got tokens or finished."""
        tokens: list[list[int]] = [[] for _ in out.scheduled]
        lps: list[list | None] = [None for _ in out.scheduled]
        for o, toks, lp in zip(owners, emitted, logprobs):
            tokens[o.index], lps[o.index] = toks, lp
        constrained = [(o.seq, o.seq.num_output_tokens) for o in owners
                       if o.seq.matcher is not None]
        changed = self.scheduler.update(out, tokens, lps)
        for seq, before in constrained:  # the grammar state follows the committed tokens
            if not seq.is_finished and not seq.matcher.consume_tokens(
                    seq.output_token_ids[before:]):
                log.warning("request %s: its output left its grammar (%s)", seq.request_id,
                            seq.matcher.get_error())
        self.speculator.drop([s for s in changed if s.is_finished], finished=True)
        return changed

    def _num_joining(self) -> int:
        """Waiting requests that the next steps admit (they will decode in this batch too)."""
        room = self.config.max_num_seqs - len(self.scheduler.running)
        return min(len(self.scheduler.waiting), max(room, 0))

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
            spec_methods={m: (c[0], c[1]) for m, c in seq.spec_methods.items()},
            metrics={"arrival_time": seq.arrival_time,
                     "first_scheduled_time": seq.first_scheduled_time or 0.0,
                     "first_token_time": seq.first_token_time or 0.0,
                     "num_preemptions": seq.num_preemptions})
        if seq.is_finished:
            self._sequences.pop(rid, None)
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
