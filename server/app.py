"""The FastAPI application: its routes (OpenAI endpoints, health, readiness, metrics) and its
middleware stack.

The routes are thin: the endpoints' work is server.generation's one flow, with
server.validation's preparation and server.renderers' formats; /v1/responses translates its
request to a chat request first and keeps its answers (server.responses). Must not touch a
`Sequence`.
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from engine import LLMEngine
from server import errors, responses
from server.generation import respond
from server.metrics import CONTENT_TYPE_LATEST
from server.middleware import (AccessMiddleware, AuthMiddleware, BodyLimitMiddleware,
                               ConnectionCapMiddleware)
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.renderers import ChatRenderer, CompletionRenderer
from server.responses_protocol import ResponsesRequest
from server.state import ServerState
from server.validation import prepare_chat, prepare_completion


def create_app(state: ServerState, engine: LLMEngine | None = None) -> FastAPI:
    """The app; its startup loads `engine` (or builds one from the config) in a thread."""
    app = FastAPI(title="specserve", version="0.1.0", lifespan=_lifespan(state, engine),
                  description="OpenAI-compatible inference with exact speculative decoding")
    errors.install(app)
    _add_probe_routes(app, state)
    _add_api_routes(app, state)
    _add_middleware(app, state)
    return app


def _lifespan(state: ServerState, engine: LLMEngine | None):
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        threading.Thread(target=state.load, args=(engine,), name="specserve-load",
                         daemon=True).start()
        yield
        if state.client is not None:
            state.client.shutdown()

    return lifespan


def create_metrics_app(state: ServerState) -> FastAPI:
    """The app of `server.metrics_port`: /metrics alone, for a port that only the scraper
    reaches (an internal interface), with no API key."""
    app = FastAPI(title="specserve metrics", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    _add_metrics_route(app, state)
    return app


def _add_metrics_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """/health and /ready (GET and HEAD); /metrics too unless it has its own port."""
    if state.config.server.metrics_port is None:
        _add_metrics_route(app, state)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.dead:
            return errors.error_response(503, f"the engine is not running: {state.dead}", None,
                                         "engine_dead")
        return {"status": "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        ranks = state.client.stats.ranks if state.client is not None else []
        if state.ready and all(alive for _, alive, *_ in ranks):
            return {"status": "ready", "model": state.model_name} | (
                {"tensor_parallel": [{"rank": r, "alive": alive} for r, alive, *_ in ranks]}
                if ranks else {})
        if state.ready:  # a tensor-parallel rank is gone: the engine is about to stop
            return errors.error_response(503, "not ready: a tensor-parallel rank is down",
                                         None, "failed")
        reason = "draining" if state.draining else "failed" if state.dead else "loading"
        return errors.error_response(503, f"not ready: {reason}", None, reason)


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=state.model_name, created=state.created)] if state.model_name else []
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await respond(state, request, req, prepare_chat, ChatRenderer)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await respond(state, request, req, prepare_completion, CompletionRenderer)

    cfg = state.config.server
    store = responses.ResponseStore(cfg.responses_store_per_key, cfg.responses_store_total)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        return await responses.create(state, store, request, req)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        return responses.retrieve(store, request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return responses.delete(store, request, response_id)


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    """Added innermost first: a request meets them in the reverse order."""
    cfg = state.config.server
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    app.add_middleware(AuthMiddleware, api_keys=cfg.api_keys)
    if cfg.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_allow_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(ConnectionCapMiddleware, retry_after_s=cfg.retry_after_s)
    app.add_middleware(AccessMiddleware, metrics=state.metrics)
