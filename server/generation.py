"""The one generation flow of both OpenAI endpoints: admit, validate, submit, then stream or
answer once every choice is done.

Chat and completions differ only in how a request is validated (server.validation) and how the
output is rendered (server.renderers); everything between, from one engine request per choice to
the last SSE event, is here. Must not touch a `Sequence`: it talks to the engine through
`EngineClient` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from engine import SamplingParams
from server import tool_parser
from server.detokenizer import IncrementalDetokenizer, StopChecker
from server.engine_client import EngineDeadError, EngineStepError
from server.errors import APIError
from server.middleware import REQUEST_ID
from server.renderers import Renderer, usage
from server.state import ServerState
from server.tool_parser import ToolCallParser
from server.validation import cache_salt, check_accepting, check_model

log = logging.getLogger("specserve.server")

Prepare = Callable[[ServerState, object], tuple[list[int], list[SamplingParams]]]


async def respond(state: ServerState, request: Request, req, prepare: Prepare,
                  renderer_cls: type[Renderer]) -> Response:
    """Chat's and completions' flow: `prepare` gives prompt ids and sampling params,
    `renderer_cls` (with a `for_request` constructor) the output format."""
    check_accepting(state)
    check_model(state, req.model)
    prompt_ids, params = prepare(state, req)
    return await serve(state, request, req, prompt_ids, params,
                       renderer_cls.for_request(state.tokenizer, req))


async def serve(state: ServerState, request: Request, req, prompt_ids: list[int],
                params: list[SamplingParams], renderer: Renderer) -> Response:
    """Every endpoint's flow once its request is a (chat or completion) request `req`, its
    prompt ids and sampling params: submit, then stream or answer once every choice is done."""
    gen = Generation.submit(state, renderer, req, prompt_ids, params,
                            cache_salt(state, request, req))
    who = {k: v for k in ("user", "safety_identifier") if (v := getattr(req, k, None))}
    if who:  # the operator's trail from a request to the end user the caller names
        log.info("%s %s %s", request.scope.get("state", {}).get(REQUEST_ID),
                 gen.completion_id, " ".join(f"{k}={v!r}" for k, v in who.items()))
    if req.stream:
        return stream_response(gen.events())
    return await run_until_done_or_disconnect(request, gen.response())


@dataclass
class ChoiceState:
    """One choice's text so far: detokenizer, stop strings, tool calls, logprobs, finish."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopChecker
    tool_calls: ToolCallParser | None = None  # offered tools: the answer may hold calls
    num_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (the engine's count)
    drafted: int = 0
    accepted: int = 0
    # method -> (drafted, accepted, token-tree verifications, their nodes)
    spec_methods: dict = field(default_factory=dict)
    finish_reason: str | None = None
    text: str = ""  # the content: without the tool calls
    entries: list = field(default_factory=list)  # (token id, logprobs) of every token
    token_ids: list = field(default_factory=list)  # the answer's tokens

    def advance(self, out) -> tuple[str, list]:
        """Feed one StreamOutput; returns (released content, logprob entries of new tokens).
        A repeated tool call ends the choice (`finish_reason` "tool_calls")."""
        if out.finished and out.finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down", None,
                           "aborted")
        self.num_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.drafted, self.accepted = out.num_drafted_tokens, out.num_accepted_tokens
        self.spec_methods = out.spec_methods
        self.token_ids += out.new_token_ids
        delta = self.detok.add(out.new_token_ids)
        if out.finished:
            delta += self.detok.flush()
        released = self.stops.feed(delta, final=out.finished)
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason
        if self.tool_calls is not None:
            released, _ = self.tool_calls.feed(released, final=self.done)
            if self.tool_calls.ended:  # a stop rule: the turn is over, abort the rest
                self.finish_reason = "tool_calls"
            elif self.tool_calls.calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"  # ended by itself after calling tools
        self.text += released
        entries = []
        if out.new_logprobs is not None and out.new_token_ids:
            entries = list(zip(out.new_token_ids, out.new_logprobs))
            self.entries += entries
        return released, entries

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Generation:
    """One request in flight: what every step of the flow needs, together."""

    state: ServerState
    renderer: Renderer
    prompt_ids: list[int]
    choices: list[ChoiceState]
    streams: list  # one RequestStream per choice
    completion_id: str
    include_usage: bool  # streamed: a last chunk with the usage
    prediction: list[int] | None = None  # the request's Predicted Output (token ids)

    @classmethod
    def submit(cls, state: ServerState, renderer: Renderer, req, prompt_ids: list[int],
               params: list[SamplingParams], salt: str | None) -> Generation:
        """Queue one engine request per choice, now (so the queue-length check sees them);
        `salt` is their prefix-cache partition."""
        # never the client's X-Request-Id: two requests sending the same one must not collide
        completion_id = renderer.new_id()
        streams = [state.client.submit(f"{completion_id}-{i}", prompt_ids, p, salt)
                   for i, p in enumerate(params)]
        parsers = [tool_parser.for_request(req, state.tokenizer) for _ in range(req.n)]
        keep = tool_parser.kept_tokens(state.tokenizer) if parsers[0] else frozenset()
        choices = [ChoiceState(i, IncrementalDetokenizer(state.tokenizer, keep=keep),
                               StopChecker(req.stop), parsers[i]) for i in range(req.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return cls(state, renderer, prompt_ids, choices, streams, completion_id, include_usage,
                   params[0].prediction)

    async def outputs(self) -> AsyncIterator[tuple[ChoiceState, str, list]]:
        """(choice, released text, new logprob entries) per engine output, until all are done.
        The engine failing under the request is a 500 (APIError) for it."""
        try:
            async for item in self._choice_outputs():
                yield item
        except (EngineStepError, EngineDeadError) as exc:
            raise APIError(500, str(exc), None, "server_error") from None

    async def _choice_outputs(self) -> AsyncIterator[tuple[ChoiceState, str, list]]:
        async for i, out in merged(self.streams):
            choice = self.choices[i]
            if choice.done:
                continue
            text, entries = choice.advance(out)
            if choice.done and not out.finished:
                self.streams[i].close()  # a stop string ended it: abort
            yield choice, text, entries
            if all(c.done for c in self.choices):
                break

    async def events(self) -> AsyncIterator[dict]:
        """The SSE events, as the renderer frames them; a failure becomes the renderer's error
        events (the status line is long gone)."""
        renderer = self.renderer
        try:
            for event in renderer.opening(self):
                yield event
            async for choice, text, entries in self.outputs():
                for event in renderer.stream_events(self, choice, text, entries):
                    yield event
            for event in renderer.closing(self):
                yield event
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for event in renderer.failed(self, exc):
                yield event

    async def response(self) -> JSONResponse:
        """The non-streamed answer, once every choice is done."""
        async for _ in self.outputs():
            pass
        return JSONResponse(self.renderer.body(self))

    def usage(self) -> dict:
        return usage(len(self.prompt_ids), self.choices, self.prediction)


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
