"""LLMEngine: requests in, tokens out.

One `step()`: schedule -> ONE target forward (prompt chunks and 1 + k verification tokens
together) -> verify (exact rejection sampling; plain sampling is the k = 0 case) -> update
(commit, roll back rejected slots, stop checks) -> propose the next drafts. The speculator
hears of the step three times (engine/spec_decode/speculator.py): its drafts are taken, the
verification's results given, and the step's record handed over with the request to propose.

Must not know about HTTP. The server drives `step()` from its own thread through a small client
class; offline users call `generate()`.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch

from engine import device_io
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, StepError
from engine.batch import RunItem
from engine.models.draft import draft_vocabulary
from engine.models.loader import resolve_device
from engine.models.pair import eos_token_ids, load_models
from engine.outputs import RequestOutput, request_output
from engine.request_check import check_request
from engine.runner_plan import RunnerPlan
from engine.sample.verifier import Verifier
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.heads import load_speculator
from engine.spec_decode.guard import StepRecord
from engine.spec_decode.speculator import build_speculator
from engine.spec_decode.traffic import TrafficRecorder
from engine.structured import Grammars

log = logging.getLogger("specserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model: torch.nn.Module | None = None,
                 tokenizer=None, draft_model: torch.nn.Module | None = None) -> None:
        self.config = config or EngineConfig()
        self.workers = None
        try:
            self._build(model, tokenizer, draft_model)
        except BaseException:
            self.close()  # tensor-parallel workers started before the failure
            raise

    def _build(self, model: torch.nn.Module | None, tokenizer,
               draft_model: torch.nn.Module | None) -> None:
        config = self.config
        self._take_threads()
        given = model  # whole: tensor-parallel workers take their shares of it
        model, tokenizer, draft_model = load_models(config, model, tokenizer, draft_model)
        self.tokenizer = tokenizer
        self.plan = plan = RunnerPlan.resolve(config, next(model.parameters()).device)
        head = load_speculator(config, model)  # a draft head reads the target's hidden states
        models = [model] + ([draft_model] if draft_model is not None else [])
        target = plan.build_target(config, model, given, models,
                                   (head,) if head is not None else ())
        self.runner, self.max_model_len = target.runner, target.max_model_len
        self.workers = self.runner.workers
        if self.workers is not None:  # stopped with the engine, or when it is collected
            self._finalizer = weakref.finalize(self, self.workers.close)
        self.device = self.runner.device
        self.vocab_size = self.runner.shape.vocab_size
        self.block_manager = BlockManager(target.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len),
            self.block_manager, eos_token_ids(model, tokenizer))
        # the target pass's time for the guard: CUDA events on CUDA (drafts queued before the
        # step are not its time), the host clock elsewhere
        self._marks = device_io.Marks(self.device)
        self.verifier = Verifier(self.vocab_size, self.device, config.seed,
                                 config.speculative.verification == "coupled", self._marks)
        self._sequences: dict[str, Sequence] = {}
        self._num_emitted: dict[str, int] = {}
        self._ids = itertools.count()
        tokenizer_size = len(tokenizer) if tokenizer is not None else None
        self.speculator = build_speculator(
            config, plan, self.runner, self.block_manager, draft_model, tokenizer_size,
            self.max_model_len, draft_vocabulary(tokenizer, config.speculative.draft_vocab_size,
                             tokenizer_size or self.vocab_size), head)
        self._grammars: Grammars | None = None  # built with the first grammar request
        self.num_grammar_requests = 0
        record = config.speculative.record  # finished requests kept to train heads on
        self.traffic = None if record is None else TrafficRecorder(record, model, config.model)

    def _take_threads(self) -> None:
        """The torch threads the config asks for; with tensor parallelism and none asked, the
        cores shared out among the ranks (given back by `close`)."""
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif config.tensor_parallel_size > 1:
            from engine.parallel.workers import threads_per_rank

            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads_per_rank(config, resolve_device(config.device)))

    def healthy(self) -> bool:
        """The engine can run another step: its device works and, with tensor parallelism,
        every rank is alive and in step."""
        return device_io.healthy(self.device) and (self.workers is None
                                                   or self.workers.healthy())

    def close(self) -> None:
        """Stop what the engine started beside it (tensor-parallel workers: a split engine
        cannot step afterwards); give back the torch threads it took. Idempotent."""
        finalizer = self.__dict__.get("_finalizer")
        if finalizer is not None:
            finalizer()
        if self.__dict__.get("traffic") is not None:
            self.traffic.close()
        threads = self.__dict__.pop("_threads_before", None)
        if threads is not None:
            torch.set_num_threads(threads)

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

    # -- requests --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what this engine cannot run (InvalidRequestError naming the field):
        engine/request_check.py. Sampling ranges are checked when `params` is built."""
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len,
                      lambda: self.grammars)

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
            seq.grammars = self.grammars
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
        intact = self.block_manager.consistent(live) and self.healthy()
        return StepError(ids, intact)

    def _step(self) -> list[RequestOutput]:
        step_started = time.perf_counter()
        out = self.scheduler.schedule()
        self._touched = seqs = [s.seq for s in out.scheduled]
        target_started = self._marks.mark()  # the pass's time includes placing its drafts
        drafts = self.speculator.take(out)  # (it forgets the preempted ones)
        if out.is_empty:
            return []
        masks = self.verifier.grammar_masks(seqs, [s.num_sample_rows for s in out.scheduled],
                                            drafts)  # computed while the target runs
        step = self.runner.execute(
            [RunItem(s.token_ids, s.start, s.seq.block_table, s.num_sample_rows,
                     s.seq.num_prompt_tokens) for s in out.scheduled], drafts)
        verified = self.verifier.verify(seqs, step.logits, step.row_offsets, drafts, masks)
        if verified.paths is not None:
            self._compact(out, verified.paths)
        self.speculator.verified(out, step, verified.tokens, drafts, verified.paths,
                                 verified.window)
        record = StepRecord(step_started, out.num_batched_tokens, len(out.scheduled),
                            [(s.num_drafts, len(t) - 1)
                             for s, t in zip(out.scheduled, verified.tokens) if t],
                            self._marks, target_started, verified.ended)
        changed = self._update(out, verified.tokens, verified.logprobs)
        self._touched = list(self.scheduler.running)  # proposing drafts touches every one
        self.speculator.propose(self.scheduler.running, [s for s in changed if s.is_finished],
                                self._num_joining(), record)
        return [self._output(seq) for seq in changed]

    def _compact(self, out: SchedulerOutput, paths: list[list[int] | None]) -> None:
        """The accepted paths of the step's token trees: their K/V to the positions after the
        committed tokens (a node's at its tree position + its index before)."""
        moves = []
        for s, path in zip(out.scheduled, paths):
            first = s.start + len(s.token_ids)  # the slot position of the tree's node 0
            moves += [(s.seq.block_table, first + node, first + d)
                      for d, node in enumerate(path or []) if node != d]
        if moves:
            self.runner.compact(moves)

    def _update(self, out: SchedulerOutput, tokens: list[list[int]],
                logprobs: list[list | None]) -> list[Sequence]:
        """Commit the emitted tokens with their logprobs (the scheduler rolls back rejected
        slots and stops sequences); returns the sequences that got tokens or finished."""
        constrained = [(s.seq, s.seq.num_output_tokens) for s, t in zip(out.scheduled, tokens)
                       if t and s.seq.matcher is not None]
        changed = self.scheduler.update(out, tokens, logprobs)
        for seq, before in constrained:  # the grammar state follows the committed tokens
            if not seq.is_finished and not seq.matcher.consume_tokens(
                    seq.output_token_ids[before:]):
                log.warning("request %s: its output left its grammar (%s)", seq.request_id,
                            seq.matcher.get_error())
        return changed

    def _num_joining(self) -> int:
        """Waiting requests that the next steps admit (they will decode in this batch too)."""
        room = self.config.max_num_seqs - len(self.scheduler.running)
        return min(len(self.scheduler.waiting), max(room, 0))

    def _output(self, seq: Sequence) -> RequestOutput:
        rid = seq.request_id
        result = request_output(seq, self._num_emitted.get(rid, 0))
        self._num_emitted[rid] = seq.num_output_tokens
        if seq.is_finished:
            self._sequences.pop(rid, None)
            self._num_emitted.pop(rid, None)
            if self.traffic is not None:  # (stop and length only: not an aborted one)
                self.traffic.record(seq.prompt_token_ids, seq.output_token_ids,
                                    seq.finish_reason, seq.cache_salt)
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
