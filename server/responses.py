"""`/v1/responses`: OpenAI's Responses API over the chat generation path, and its store.

A request becomes a chat request (server.responses_protocol.as_chat) and runs through the one
generation flow (server.generation.serve); `ResponsesRenderer` renders the output as a Response
object, or as the typed events `responses.stream()` consumes, built from the `openai` package's
own types. `ResponseStore` keeps finished responses in memory for `previous_response_id`,
`GET` and `DELETE`, per API key and cache_salt, bounded, oldest evicted first. Must not touch
the engine: everything about it goes through the generation flow.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response as HTTPResponse
from openai.types.responses import (FunctionTool, Response, ResponseCompletedEvent,
                                    ResponseContentPartAddedEvent,
                                    ResponseContentPartDoneEvent, ResponseCreatedEvent,
                                    ResponseErrorEvent, ResponseFailedEvent,
                                    ResponseFunctionCallArgumentsDeltaEvent,
                                    ResponseFunctionCallArgumentsDoneEvent,
                                    ResponseFunctionToolCall, ResponseIncompleteEvent,
                                    ResponseInProgressEvent, ResponseOutputItemAddedEvent,
                                    ResponseOutputItemDoneEvent, ResponseOutputMessage,
                                    ResponseOutputText, ResponseTextDeltaEvent,
                                    ResponseTextDoneEvent)

from server.errors import APIError
from server.generation import ChoiceState, Generation, serve
from server.middleware import TENANT
from server.renderers import Renderer, error_body_of
from server.responses_protocol import (FunctionChoice, ResponsesRequest, as_chat,
                                       output_to_messages, responses_param)
from server.state import ServerState
from server.validation import check_accepting, check_model, prepare_chat


# -- the store -------------------------------------------------------------------------------

@dataclass
class Stored:
    response: dict  # the Response object, as returned
    conversation: list[dict]  # chat messages: the stored history, the input, the output


@dataclass
class ResponseStore:
    """Finished responses by (partition, id); a partition is an API key's tenant and a
    cache_salt, so no caller reads or continues another's. Bounded per partition and in all,
    the oldest evicted first."""

    per_partition: int
    total: int
    _items: OrderedDict = field(default_factory=OrderedDict)  # (partition, id) -> Stored
    _counts: dict = field(default_factory=dict)  # partition -> number stored

    @property
    def enabled(self) -> bool:
        return self.per_partition > 0 and self.total > 0

    def put(self, partition: tuple, stored: Stored) -> None:
        if self._counts.get(partition, 0) >= self.per_partition:
            oldest = next(k for k in self._items if k[0] == partition)
            self._remove(oldest)
        if len(self._items) >= self.total:
            self._remove(next(iter(self._items)))
        self._items[(partition, stored.response["id"])] = stored
        self._counts[partition] = self._counts.get(partition, 0) + 1

    def get(self, partition: tuple, response_id: str, param: str | None = None) -> Stored:
        stored = self._items.get((partition, response_id))
        if stored is None:  # another partition's is as missing as one never made
            raise APIError(404, f"no response with id {response_id!r} is stored", param,
                           "response_not_found")
        return stored

    def delete(self, partition: tuple, response_id: str) -> None:
        self.get(partition, response_id)
        self._remove((partition, response_id))

    def _remove(self, key: tuple) -> None:
        del self._items[key]
        self._counts[key[0]] -= 1
        if not self._counts[key[0]]:
            del self._counts[key[0]]


def partition(request: Request, salt: str | None) -> tuple:
    return request.scope.get("state", {}).get(TENANT), salt


# -- the flows of the routes -------------------------------------------------------------------

async def create(state: ServerState, store: ResponseStore, request: Request,
                 req: ResponsesRequest) -> HTTPResponse:
    check_accepting(state)
    check_model(state, req.model)
    if req.store and not store.enabled:
        raise APIError(400, "this server keeps no responses (responses_store_per_key is 0): "
                            "store must be false", "store", "invalid_value")
    where = partition(request, req.cache_salt)
    history = (store.get(where, req.previous_response_id, "previous_response_id").conversation
               if req.previous_response_id else [])
    chat, new_messages = as_chat(req, history)
    try:
        prompt_ids, params = prepare_chat(state, chat)
    except APIError as exc:  # named as the Responses API names it
        param = responses_param(exc.param)
        if param != exc.param and exc.message.startswith(f"{exc.param} "):
            exc.message = param + exc.message[len(exc.param):]
        exc.param = param
        raise
    keep = None
    if req.store is not False and store.enabled:
        def keep(response: dict) -> None:
            conversation = history + new_messages + output_to_messages(response["output"])
            store.put(where, Stored(response, conversation))
    return await serve(state, request, chat, prompt_ids, params,
                       ResponsesRenderer(state.tokenizer, req, keep))


def retrieve(store: ResponseStore, request: Request, response_id: str) -> dict:
    return store.get(partition(request, _query(request)), response_id).response


def delete(store: ResponseStore, request: Request, response_id: str) -> dict:
    store.delete(partition(request, _query(request)), response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _query(request: Request) -> str | None:
    """The query of GET and DELETE: `cache_salt` (the partition a response was stored in) and
    `include` (the stored response is returned as it was made); anything else is a 400."""
    for name in request.query_params:
        if name not in ("cache_salt", "include", "include[]"):
            raise APIError(400, f"unrecognized query parameter: {name}", name,
                           "invalid_value")
    return request.query_params.get("cache_salt")


# -- the output --------------------------------------------------------------------------------

class ResponsesRenderer(Renderer):
    """One Response (n is 1): a message item with the text and a function_call item per call,
    in the order they began. Streamed: created, in_progress, each item's added / deltas / done,
    then completed (or incomplete, or failed) with the whole response and its usage."""

    def __init__(self, tokenizer, req: ResponsesRequest, keep=None) -> None:
        self.tokenizer, self.req, self.keep = tokenizer, req, keep
        self.created_at = time.time()
        self.seq = 0  # the stream's sequence numbers
        self.order: list = []  # "message" or a call's index, in the order the items began
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.call_ids: list[str] = []  # the function_call items' ids
        self.held = ""  # streamed text not sent yet: whitespace before any call or text
        self.held_logprobs: list = []
        self.logprobs: list = []  # of the streamed text

    def new_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    # -- streamed ----------------------------------------------------------------------------
    def opening(self, gen: Generation) -> list[dict]:
        response = self._response(gen, "in_progress", [])
        return [self._event(ResponseCreatedEvent, response=response),
                self._event(ResponseInProgressEvent, response=response)]

    def stream_events(self, gen: Generation, choice: ChoiceState, text: str,
                      entries: list) -> list[dict]:
        events = []
        if text or entries:
            events += self._text_events(text, self._logprobs(entries))
        calls = choice.tool_calls.calls if choice.tool_calls is not None else []
        for index in range(len(self.call_ids), len(calls)):
            events += self._call_events(index, calls[index])
        return events

    def closing(self, gen: Generation) -> list[dict]:
        choice = gen.choices[0]
        events = []
        if "message" not in self.order and not self.call_ids:  # whitespace or nothing
            events += self._open_message()
            if self.held:
                events.append(self._delta(self.held, self.held_logprobs))
                self.logprobs += self.held_logprobs
        if "message" in self.order:
            position = self.order.index("message")
            message = self._message(choice, self.logprobs)
            text = message.content[0]
            events += [self._event(ResponseTextDoneEvent, item_id=self.message_id,
                                   output_index=position, content_index=0, text=text.text,
                                   logprobs=self.logprobs),
                       self._event(ResponseContentPartDoneEvent, item_id=self.message_id,
                                   output_index=position, content_index=0, part=text),
                       self._event(ResponseOutputItemDoneEvent, output_index=position,
                                   item=message)]
        response = self._final(gen)
        kind = (ResponseIncompleteEvent if response.status == "incomplete"
                else ResponseCompletedEvent)
        return events + [self._event(kind, response=response)]

    def failed(self, gen: Generation, exc: Exception) -> list[dict]:
        error = error_body_of(exc)["error"]
        response = self._response(gen, "failed", [], error={
            "code": "server_error" if error["type"] == "server_error" else "invalid_prompt",
            "message": error["message"]})
        return [self._event(ResponseErrorEvent, code=error["code"], message=error["message"],
                            param=error["param"]),
                self._event(ResponseFailedEvent, response=response)]

    def _text_events(self, text: str, logprobs: list) -> list[dict]:
        if "message" not in self.order:
            self.held += text
            self.held_logprobs += logprobs
            if not self.held.strip():  # whitespace before a call is not an answer yet
                return []
            text, logprobs, self.held, self.held_logprobs = self.held, self.held_logprobs, "", []
            events = self._open_message()
        else:
            events = []
        self.logprobs += logprobs
        return events + [self._delta(text, logprobs)]

    def _delta(self, text: str, logprobs: list) -> dict:
        return self._event(ResponseTextDeltaEvent, item_id=self.message_id,
                           output_index=self.order.index("message"), content_index=0,
                           delta=text, logprobs=logprobs)

    def _open_message(self) -> list[dict]:
        self.order.append("message")
        position = len(self.order) - 1
        item = ResponseOutputMessage(id=self.message_id, type="message", role="assistant",
                                     status="in_progress", content=[])
        part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
        return [self._event(ResponseOutputItemAddedEvent, output_index=position, item=item),
                self._event(ResponseContentPartAddedEvent, item_id=self.message_id,
                            output_index=position, content_index=0, part=part)]

    def _call_events(self, index: int, call: dict) -> list[dict]:
        """A call is parsed whole: added, its arguments in one delta, done."""
        self.order.append(index)
        self.call_ids.append(f"fc_{uuid.uuid4().hex}")
        position = len(self.order) - 1
        item = self._call(index, call)
        arguments = item.arguments
        opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        item_id = self.call_ids[index]
        return [self._event(ResponseOutputItemAddedEvent, output_index=position, item=opened),
                self._event(ResponseFunctionCallArgumentsDeltaEvent, item_id=item_id,
                            output_index=position, delta=arguments),
                self._event(ResponseFunctionCallArgumentsDoneEvent, item_id=item_id,
                            output_index=position, arguments=arguments),
                self._event(ResponseOutputItemDoneEvent, output_index=position, item=item)]

    def _event(self, kind, **fields) -> dict:
        event = kind(type=kind.model_fields["type"].annotation.__args__[0],
                     sequence_number=self.seq, **fields)
        self.seq += 1
        return {"event": event.type, "data": event.model_dump_json(exclude_unset=True)}

    # -- the whole response ------------------------------------------------------------------
    def body(self, gen: Generation) -> dict:
        choice = gen.choices[0]
        calls = choice.tool_calls.calls if choice.tool_calls is not None else []
        self.order = (["message"] if choice.text.strip() or not calls else []) + list(
            range(len(calls)))
        self.call_ids = [f"fc_{uuid.uuid4().hex}" for _ in calls]
        self.logprobs = self._logprobs(choice.entries)
        return self._final(gen).model_dump(mode="json", exclude_unset=True)

    def _final(self, gen: Generation) -> Response:
        """The finished response, in `self.order`; kept in the store if asked."""
        choice = gen.choices[0]
        calls = choice.tool_calls.calls if choice.tool_calls is not None else []
        output = [self._message(choice, self.logprobs) if item == "message"
                  else self._call(item, calls[item]) for item in self.order]
        incomplete = choice.finish_reason == "length"
        response = self._response(
            gen, "incomplete" if incomplete else "completed", output, usage=gen.usage(),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        if self.keep is not None:
            self.keep(response.model_dump(mode="json", exclude_unset=True))
        return response

    def _message(self, choice: ChoiceState, logprobs: list) -> ResponseOutputMessage:
        text = ResponseOutputText(type="output_text", text=choice.text, annotations=[],
                                  logprobs=logprobs)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return ResponseOutputMessage(id=self.message_id, type="message", role="assistant",
                                     status=status, content=[text])

    def _call(self, index: int, call: dict) -> ResponseFunctionToolCall:
        return ResponseFunctionToolCall(
            type="function_call", id=self.call_ids[index], call_id=call["id"],
            name=call["function"]["name"], arguments=call["function"]["arguments"],
            status="completed")

    def _response(self, gen: Generation, status: str, output: list, usage: dict | None = None,
                  incomplete_details: dict | None = None, error: dict | None = None
                  ) -> Response:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format else None
        tools = [FunctionTool(type="function", name=t.name, description=t.description,
                              parameters=t.parameters, strict=t.strict)
                 for t in req.tools or ()]
        choice = req.tool_choice
        return Response(
            id=gen.completion_id, object="response", created_at=self.created_at,
            status=status, model=gen.state.model_name, output=output, error=error,
            incomplete_details=incomplete_details, instructions=req.instructions,
            metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            tool_choice=(choice.model_dump() if isinstance(choice, FunctionChoice)
                         else choice or "auto"),
            tools=tools, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, background=False,
            store=self.keep is not None, service_tier="default", truncation="disabled",
            text={"format": echo_format(fmt)},
            top_logprobs=req.top_logprobs, user=req.user,
            safety_identifier=req.safety_identifier, prompt_cache_key=req.prompt_cache_key,
            reasoning=None, usage=response_usage(usage) if usage is not None else None)

    def _logprobs(self, entries: list) -> list:
        if not self.req.with_logprobs:
            return []
        return [{**self._token(tok, chosen), "top_logprobs": [self._token(t, lp)
                                                              for t, lp in top]}
                for tok, (chosen, top) in entries]

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def echo_format(fmt) -> dict:
    """The response's `text.format`: the request's (a schema of true or none is {}: any
    value)."""
    if fmt is None:
        return {"type": "text"}
    body = fmt.model_dump(by_alias=True, exclude_none=True)
    if fmt.type == "json_schema" and not isinstance(body.get("schema"), dict):
        body["schema"] = {}
    return body


def response_usage(chat_usage: dict) -> dict:
    """The chat usage in the Responses form (input/output tokens), with its extras."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    # the prompt tokens computed (not served by the prefix cache) are what the cache gains
    body = {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens":
                                     chat_usage["prompt_tokens"] - cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
    details = chat_usage.get("completion_tokens_details")
    if details:  # Predicted Outputs (an extra here)
        body["output_tokens_details"].update(details)
    if "speculative" in chat_usage:
        body["speculative"] = chat_usage["speculative"]
    return body
