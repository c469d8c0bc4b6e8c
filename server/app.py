"""The FastAPI application: OpenAI-compatible routes, health, readiness, metrics.

Must not touch a `Sequence`: it talks to the engine through `EngineClient` only. Tokenization,
chat templates, incremental detokenization and stop strings live here, not in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from engine import EngineConfig, LLMEngine, SamplingParams
from server import errors
from server.config import AppConfig
from server.detokenizer import IncrementalDetokenizer, StopChecker
from server.engine_client import EngineClient
from server.errors import APIError
from server.metrics import CONTENT_TYPE_LATEST, Metrics
from server.middleware import AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList,
                             new_id, now)

log = logging.getLogger("specserve.server")


@dataclass
class ServerState:
    config: AppConfig
    engine: LLMEngine | None = None
    client: EngineClient | None = None
    tokenizer: object = None
    model_name: str = ""
    load_error: str | None = None
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=now)

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.alive and not self.draining

    def load(self, engine: LLMEngine | None = None) -> None:
        """Build the engine (unless given) and start its thread; runs off the event loop."""
        try:
            engine_config: EngineConfig = self.config.engine_config()
            self.engine = engine or LLMEngine(engine_config)
            self.tokenizer = self.engine.tokenizer
            self.model_name = (self.config.server.served_model_name
                               or _model_name(engine_config.model))
            spec = engine_config.speculative
            self.metrics.set_info(
                model=self.model_name, engine_model=engine_config.model,
                draft_model=spec.draft_model or "", speculative_method=spec.method,
                k_max=spec.k_max, adaptive=spec.adaptive, dtype=engine_config.dtype,
                device=str(self.engine.device), block_size=engine_config.block_size,
                num_blocks=self.engine.block_manager.num_blocks,
                max_model_len=self.engine.max_model_len)
            client = EngineClient(self.engine)
            client.step_listeners.append(self.metrics.observe_step)
            client.start()
            self.client = client
            log.info("engine ready: %s (%d KV blocks, context %d)", self.model_name,
                     self.engine.block_manager.num_blocks, self.engine.max_model_len)
        except Exception as exc:  # reported by /ready and /health
            log.exception("failed to load the engine")
            self.load_error = f"{type(exc).__name__}: {exc}"


def _model_name(model: str) -> str:
    from engine.models.loader import model_label

    return model_label(model)


# -- request preparation -------------------------------------------------------------------

def check_accepting(state: ServerState) -> None:
    retry = {"Retry-After": str(state.config.server.retry_after_s)}
    if state.draining:
        raise APIError(503, "the server is shutting down", None, "draining", retry)
    if state.client is None or not state.client.alive:
        message = "the model is still loading" if state.load_error is None else "engine failed"
        raise APIError(503, message, None, "not_ready", retry)
    client = state.client
    queued = client.num_in_flight - client.num_running
    if queued >= state.config.server.max_waiting_requests:
        raise APIError(429, "too many requests are waiting; retry later", None,
                       "queue_full", retry)


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", "model", "model_not_found")


def render_chat(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       "messages", "no_chat_template")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    except Exception as exc:  # a template may reject a message order
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages",
                       "invalid_messages") from None
    return list(ids)


def sampling_params(state: ServerState, req, prompt_len: int, max_tokens: int | None,
                    num_logprobs: int | None, param_prompt: str) -> list[SamplingParams]:
    """One SamplingParams per choice; a 400 naming the field for anything out of range."""
    context = state.engine.max_model_len
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens, but the context length is "
                            f"{context}", param_prompt, "context_length_exceeded")
    room = context - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"max_tokens is {max_tokens}, but only {room} tokens fit after the "
                            f"{prompt_len}-token prompt (context {context})", "max_tokens",
                       "context_length_exceeded")
    if req.n > state.config.server.max_n:
        raise APIError(400, f"n must be at most {state.config.server.max_n}", "n", "invalid_value")
    vocab = state.engine.vocab_size
    if req.logit_bias and max(req.logit_bias) >= vocab:
        raise APIError(400, f"logit_bias token ids must be below {vocab}", "logit_bias",
                       "invalid_value")
    out = []
    for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i) % (2 ** 63)
        try:
            out.append(SamplingParams(
                max_tokens=max_tokens or room, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, min_p=req.min_p, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
                seed=seed, logprobs=num_logprobs, ignore_eos=req.ignore_eos,
                speculative=req.speculative is not False))
        except ValueError as exc:
            raise APIError(400, str(exc), errors.param_from_value_error(exc),
                           "invalid_value") from None
    return out


# -- generation ----------------------------------------------------------------------------

@dataclass
class ChoiceState:
    """One choice's text so far: detokenizer, stop strings, logprobs, finish."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopChecker
    num_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    text: str = ""
    entries: list = field(default_factory=list)  # (token id, logprobs) of every token

    def advance(self, out) -> tuple[str, list]:
        """Feed one engine output; returns (released text, logprob entries of new tokens)."""
        if out.finished and out.finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down", None,
                           "aborted")
        self.num_tokens = len(out.output_token_ids)
        self.drafted, self.accepted = out.num_drafted_tokens, out.num_accepted_tokens
        delta = self.detok.add(out.new_token_ids)
        if out.finished:
            delta += self.detok.flush()
        released = self.stops.feed(delta, final=out.finished)
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason
        self.text += released
        entries = []
        if out.logprobs is not None and out.new_token_ids:
            entries = out.logprobs[len(out.output_token_ids) - len(out.new_token_ids):]
            entries = [(tok, lp) for tok, lp in zip(out.new_token_ids, entries)]
            self.entries += entries
        return released, entries

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def submit(state: ServerState, prompt_ids: list[int], params: list[SamplingParams],
           completion_id: str) -> list:
    """Queue one engine request per choice, now (so the queue-length check sees them)."""
    return [state.client.submit(f"{completion_id}-{i}", prompt_ids, p)
            for i, p in enumerate(params)]


async def merged(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(choice index, engine output) from all choices as they come; aborts all on exit."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            stream.close()
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_choices = len(tasks)
    try:
        while open_choices:
            i, item = await queue.get()
            if item is None:
                open_choices -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield i, item
    finally:  # closing a stream before its end aborts its engine request
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def _token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, entries) -> list[dict]:
    out = []
    for tok, (chosen, top) in entries:
        text, raw = _token_text(tokenizer, tok)
        tops = []
        for t, lp in top:
            ttext, traw = _token_text(tokenizer, t)
            tops.append({"token": ttext, "logprob": lp, "bytes": traw})
        out.append({"token": text, "logprob": chosen, "bytes": raw, "top_logprobs": tops})
    return out


def usage(prompt_len: int, choices: list[ChoiceState]) -> dict:
    completion = sum(c.num_tokens for c in choices)
    body = {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion}
    drafted = sum(c.drafted for c in choices)
    if drafted:
        body["speculative"] = {"drafted_tokens": drafted,
                               "accepted_tokens": sum(c.accepted for c in choices)}
    return body


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_done_or_disconnect(request: Request, coro):
    """Await `coro`, but cancel it (aborting its engine requests) if the client leaves."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watcher.cancel()
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):
        pass
    return Response(status_code=499)


def stream_response(events: AsyncIterator[dict]) -> EventSourceResponse:
    return EventSourceResponse(events, ping=15, headers={"Cache-Control": "no-cache",
                                                         "X-Accel-Buffering": "no"})


def error_event(exc: Exception) -> dict:
    if isinstance(exc, APIError):
        body = errors.error_body(exc.status, exc.message, exc.param, exc.code)
    else:
        log.error("error in a stream: %s", exc)
        body = errors.error_body(500, "the request failed while generating", None,
                                 "generation_failed")
    return {"data": json.dumps(body)}


# -- the app -------------------------------------------------------------------------------

def create_app(state: ServerState, engine: LLMEngine | None = None) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=state.load, args=(engine,), name="specserve-load",
                         daemon=True).start()
        yield
        if state.client is not None:
            state.client.shutdown()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible inference with exact speculative decoding")
    errors.install(app)
    cfg = state.config.server

    @app.get("/health")
    async def health():
        if state.load_error or (state.client is not None and not state.client.alive):
            return errors.error_response(503, "the engine is not running", None, "engine_dead")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready:
            return {"status": "ready", "model": state.model_name}
        reason = ("draining" if state.draining else "failed" if state.load_error
                  else "loading")
        return errors.error_response(503, f"not ready: {reason}", None, reason)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=state.model_name, created=state.created)] if state.model_name else []
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_accepting(state)
        check_model(state, req.model)
        prompt_ids = render_chat(state, req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params(state, req, len(prompt_ids), max_tokens,
                                 (req.top_logprobs or 0) if req.logprobs else None, "messages")
        choices = [ChoiceState(i, IncrementalDetokenizer(state.tokenizer), StopChecker(req.stop))
                   for i in range(req.n)]
        # never the client's X-Request-Id: two requests sending the same one must not collide
        completion_id = new_id("chatcmpl")
        streams = submit(state, prompt_ids, params, completion_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(chat_stream(state, req, prompt_ids, streams, choices,
                                               completion_id, include_usage))
        return await run_until_done_or_disconnect(
            request, chat_full(state, req, prompt_ids, streams, choices, completion_id))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_accepting(state)
        check_model(state, req.model)
        prompt_ids = completion_prompt(state, req)
        params = sampling_params(state, req, len(prompt_ids), req.max_tokens or 16,
                                 req.logprobs, "prompt")
        choices = [ChoiceState(i, IncrementalDetokenizer(state.tokenizer), StopChecker(req.stop))
                   for i in range(req.n)]
        completion_id = new_id("cmpl")
        streams = submit(state, prompt_ids, params, completion_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(completion_stream(state, req, prompt_ids, streams, choices,
                                                     completion_id, include_usage))
        return await run_until_done_or_disconnect(
            request, completion_full(state, req, prompt_ids, streams, choices, completion_id))

    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    app.add_middleware(AuthMiddleware, api_keys=cfg.api_keys)
    if cfg.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_allow_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)
    app.add_middleware(RequestIdMiddleware)
    return app


class HTTPMetricsMiddleware:
    ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
              "/metrics"}

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope["path"] if scope["path"] in self.ROUTES else "other"
            self.metrics.observe_http(route, status[0] or 499)


def completion_prompt(state: ServerState, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt, add_special_tokens=False) or _empty_prompt()
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        vocab = state.engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt",
                           "invalid_value")
        return prompt
    raise APIError(400, "batched prompts are not supported; send one prompt per request",
                   "prompt", "invalid_value")


def _empty_prompt():
    raise APIError(400, "the prompt is empty", "prompt", "invalid_value")


async def run_to_completion(state, streams, choices) -> None:
    """Feed every choice its engine outputs until all are done (non-streamed responses)."""
    async for i, out in merged(streams):
        choice = choices[i]
        if choice.done:
            continue
        choice.advance(out)
        if choice.done and not out.finished:
            streams[i].close()  # a stop string ended it: abort
        if all(c.done for c in choices):
            break


async def chat_full(state, req, prompt_ids, streams, choices, completion_id):
    await run_to_completion(state, streams, choices)
    body = {"id": completion_id, "object": "chat.completion", "created": now(),
            "model": state.model_name, "system_fingerprint": None,
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": ({"content": chat_logprobs(state.tokenizer, c.entries)}
                                      if req.logprobs else None),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(len(prompt_ids), choices)}
    return JSONResponse(body)


def _chunk(completion_id, model, choices, usage_body=None, include_usage=False):
    body = {"id": completion_id, "object": "chat.completion.chunk", "created": now(),
            "model": model, "system_fingerprint": None, "choices": choices}
    if include_usage:
        body["usage"] = usage_body
    return {"data": json.dumps(body)}


async def chat_stream(state, req, prompt_ids, streams, choices, completion_id, include_usage):
    model = state.model_name
    try:
        for c in choices:  # the role, once, first
            yield _chunk(completion_id, model, [{"index": c.index, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                         None, include_usage)
        async for i, out in merged(streams):
            c = choices[i]
            if c.done:
                continue
            text, entries = c.advance(out)
            if text or entries:
                lp = ({"content": chat_logprobs(state.tokenizer, entries)}
                      if req.logprobs else None)
                yield _chunk(completion_id, model, [{"index": i, "delta": {"content": text},
                                                     "logprobs": lp, "finish_reason": None}],
                             None, include_usage)
            if c.done:
                if not out.finished:
                    streams[i].close()  # a stop string ended it: abort
                yield _chunk(completion_id, model, [{"index": i, "delta": {}, "logprobs": None,
                                                     "finish_reason": c.finish_reason}],
                             None, include_usage)
            if all(ch.done for ch in choices):
                break
        if include_usage:
            yield _chunk(completion_id, model, [], usage(len(prompt_ids), choices), True)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        yield error_event(exc)
    yield {"data": "[DONE]"}


def completion_logprobs(tokenizer, entries, offset0: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    for tok, (chosen, top) in entries:
        text = tokenizer.decode([tok])
        tokens.append(text)
        token_lps.append(chosen)
        tops.append({tokenizer.decode([t]): lp for t, lp in top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


async def completion_full(state, req, prompt_ids, streams, choices, completion_id):
    await run_to_completion(state, streams, choices)
    body = {"id": completion_id, "object": "text_completion", "created": now(),
            "model": state.model_name, "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": (completion_logprobs(state.tokenizer, c.entries, 0)
                                      if req.logprobs is not None else None),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(len(prompt_ids), choices)}
    return JSONResponse(body)


async def completion_stream(state, req, prompt_ids, streams, choices, completion_id,
                            include_usage):
    model = state.model_name

    def chunk(choice_list, usage_body=None):
        body = {"id": completion_id, "object": "text_completion", "created": now(),
                "model": model, "system_fingerprint": None, "choices": choice_list}
        if include_usage:
            body["usage"] = usage_body
        return {"data": json.dumps(body)}

    try:
        async for i, out in merged(streams):
            c = choices[i]
            if c.done:
                continue
            text, entries = c.advance(out)
            if text or c.done:
                lp = (completion_logprobs(state.tokenizer, entries, len(c.text) - len(text))
                      if req.logprobs is not None else None)
                yield chunk([{"index": i, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason}])
            if c.done and not out.finished:
                streams[i].close()  # a stop string ended it: abort
            if all(ch.done for ch in choices):
                break
        if include_usage:
            yield chunk([], usage(len(prompt_ids), choices))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        yield error_event(exc)
    yield {"data": "[DONE]"}


# -- running -------------------------------------------------------------------------------

def serve(config: AppConfig, engine: LLMEngine | None = None) -> None:
    """Serve until SIGTERM/SIGINT; then drain (finish in-flight up to drain_timeout_s), exit 0."""
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(config)
    app = create_app(state, engine)
    uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                               log_level=config.server.log_level, access_log=False,
                               timeout_graceful_shutdown=5)
    DrainingServer(uv_config, state).run()


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: stop accepting (503, /ready false), let in-flight requests
    finish for up to drain_timeout_s, abort the rest, then shut down and exit 0.

    It replaces uvicorn's own handler, which would shut down at once (and make sse-starlette
    cancel every open stream)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:  # a signal handler, in the main thread
        if self.state.draining:  # a second signal: stop now
            self.should_exit = True
            return
        self.state.draining = True
        log.info("signal %s: draining for up to %.0fs", sig,
                 self.state.config.server.drain_timeout_s)
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        client = self.state.client
        deadline = time.monotonic() + self.state.config.server.drain_timeout_s
        while client is not None and client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client is not None and client.num_in_flight:
            log.warning("drain timeout: aborting %d request(s)", client.num_in_flight)
            client.abort_all()
            for _ in range(100):  # let their responses send the final events
                if not client.num_in_flight:
                    break
                await asyncio.sleep(0.02)
        self.should_exit = True
