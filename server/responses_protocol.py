"""The Responses API's request (`POST /v1/responses`) and its translation to a chat request.
Must not touch the engine.

A Responses request is a chat request in another shape: `instructions` and the input items
(messages, `function_call` and `function_call_output` items) are the messages, function tools
and `tool_choice` lose a level of nesting, `text.format` is `response_format`. `as_chat` turns
one into a `ChatCompletionRequest`, so both endpoints share one generation path (templating,
tool parsing, structured output, sampling); only the output's shape differs
(server.responses). Every top-level field is decided in `RESPONSES_FIELDS` (served, or a 400
naming it), as for chat.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)

from server.errors import APIError, describe_validation
from server.protocol import (MAX_IDENTIFIER, AccountFields, ChatCompletionRequest,
                             Prediction, _only, refused_fields)


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Item):
    """A text part of a message: input_text (any role) or output_text (an earlier answer)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None  # of an earlier answer: none are made here
    logprobs: Optional[list] = None  # of an earlier answer
    prompt_cache_breakpoint: Optional[dict] = None  # every prefix is cached anyway


class RefusalContent(_Item):
    type: Literal["refusal"]
    refusal: str


# the branches of a union are tagged "type=<an item's type>" (an error's param drops them)
def _part_type(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "type=" + (kind if kind in ("input_text", "output_text", "refusal") else "unserved")


class Unserved(BaseModel):
    """A kind of item, part or tool this server does not serve: a 400 saying why."""

    type: str
    why: ClassVar[str] = ""  # {type} is the kind's

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(self.why.format(type=repr(self.type)))


class UnservedContent(Unserved):
    why = "content parts of type {type} are not served: this server's model reads text only"


Content = Annotated[Union[Annotated[TextContent, Tag("type=input_text")],
                          Annotated[TextContent, Tag("type=output_text")],
                          Annotated[RefusalContent, Tag("type=refusal")],
                          Annotated[UnservedContent, Tag("type=unserved")]],
                    Discriminator(_part_type)]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Content]]
    id: Optional[str] = None  # of an earlier output item
    status: Optional[str] = None
    phase: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextContent) else p.refusal
                       for p in self.content)


class FunctionCallItem(_Item):
    """A function call of an earlier answer."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None
    # of calls this server never makes (namespaced, programmatic, asynchronous): null only
    namespace: Optional[str] = None
    caller: Optional[dict] = None
    async_: Optional[bool] = Field(default=None, alias="async")

    @field_validator("namespace", "caller", "async_")
    @classmethod
    def _plain_calls_only(cls, value):
        if value:
            raise ValueError("only direct calls of function tools are served")
        return value


class FunctionCallOutputItem(_Item):
    """A function call's result, for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[Content]]
    id: Optional[str] = None
    status: Optional[str] = None
    name: Optional[str] = None  # the call's, for the reader
    namespace: Optional[str] = None
    caller: Optional[dict] = None

    _unserved = refused_fields({name: "only direct calls of function tools are served"
                                for name in ("namespace", "caller")})

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text if isinstance(p, TextContent) else p.refusal for p in self.output)


class UnservedItem(Unserved):
    why = ("input items of type {type} are not served: only message, function_call and "
           "function_call_output items (reasoning: this server's model does not reason; "
           "item_reference: use previous_response_id)")


def _item_type(value) -> str:
    kind = (value.get("type", "message") if isinstance(value, dict)
            else getattr(value, "type", None))
    known = ("message", "function_call", "function_call_output")
    return "type=" + (kind if kind in known else "unserved")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                            Annotated[UnservedItem, Tag("type=unserved")]],
                      Discriminator(_item_type)]


class FunctionTool(_Item):
    """A function tool, in the Responses form (no `function` level)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None  # calls the grammar enforces always follow the schema


def _tool_type(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "type=function" if kind == "function" else "type=unserved"


class UnservedTool(Unserved):
    why = ("tools of type {type} are not served: only function tools (this server runs no "
           "hosted tools)")


ToolParam = Annotated[Union[Annotated[FunctionTool, Tag("type=function")],
                            Annotated[UnservedTool, Tag("type=unserved")]],
                      Discriminator(_tool_type)]


class FunctionChoice(_Item):
    type: Literal["function"]
    name: str


class TextFormat(_Item):
    """`text.format`: text, json_object, or json_schema (name, schema, strict at this level)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Union[dict, bool, None] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced

    @model_validator(mode="after")
    def _named(self):
        if self.type == "json_schema" and self.name is None:
            raise ValueError("type json_schema needs a name")
        return self

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {
            "name": self.name, "description": self.description, "schema": self.json_schema,
            "strict": self.strict}}


class TextConfig(_Item):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None

    _unserved = refused_fields({"verbosity": "verbosity is not served: the model's answer "
                                             "length follows the prompt and max_output_tokens"})


class ReasoningConfig(_Item):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None

    @model_validator(mode="after")
    def _no_reasoning(self):
        if self.effort not in (None, "none") or self.summary or self.generate_summary:
            raise ValueError("this server's model does not reason: only effort 'none', "
                             "without a summary")
        return self


class StreamOptions(_Item):
    include_obfuscation: Optional[bool] = None  # no padding is added to deltas either way


INCLUDABLE = ("file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(AccountFields):
    model_config = ConfigDict(extra="forbid")  # an unknown argument is a 400 naming it
    model: str
    input: Union[str, list[InputItem]] = Field(default_factory=list)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None  # None: stored when the server keeps responses
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[ToolParam]] = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = Field(default=None, ge=1)  # built-in tools only: none run
    text: Optional[TextConfig] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    reasoning: Optional[ReasoningConfig] = None
    truncation: Optional[str] = None
    user: Optional[str] = Field(default=None, max_length=MAX_IDENTIFIER)
    # refused unless null (or false)
    background: Optional[bool] = None
    background_options: Optional[dict] = None
    conversation: Union[str, dict, None] = None
    prompt: Optional[dict] = None
    context_management: Optional[list] = None
    moderation: Optional[dict] = None
    image: Optional[dict] = None
    access_programs: Optional[list] = None
    # extras, as on chat
    seed: Optional[int] = Field(default=None, ge=-(2 ** 63), lt=2 ** 63)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stop: Union[str, list[str], None] = None
    ignore_eos: Optional[bool] = None
    speculative: Optional[bool] = None
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)
    prediction: Optional[Prediction] = None

    @field_validator("background")
    @classmethod
    def _no_background(cls, value):
        if value:
            raise ValueError("background responses are not served: stream instead")
        return value

    _unserved = refused_fields({
        "background_options": "background responses are not served",
        "conversation": "conversations are not stored here: use previous_response_id",
        "prompt": "stored prompt templates are not served: send instructions",
        "context_management": "context compaction is not served",
        "moderation": "no moderation model runs here",
        "image": "image generation is not served",
        "access_programs": "programs are not served"})

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, value):
        return _only(value, ("disabled",), "an input longer than the context is a 400: only "
                     "'disabled'")

    @field_validator("include")
    @classmethod
    def _check_include(cls, value):
        for name in value or ():
            if name not in INCLUDABLE:
                raise ValueError(f"{name!r} is not an includable field; one of "
                                 f"{', '.join(INCLUDABLE)}")
        return value

    @property
    def with_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def input_items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


# What each field of the official client's responses.create does here (openai 3.57), as
# CHAT_FIELDS says for chat; tests/test_request_fields.py walks the client's parameters.
RESPONSES_FIELDS = {
    "model": "served: must name the served model (else 404)",
    "input": "served: text, or message (text parts), function_call and function_call_output "
             "items; image, file and audio parts and other item types refused",
    "instructions": "served: a system message first (not carried over by "
                    "previous_response_id, as OpenAI does)",
    "previous_response_id": "served: the stored conversation it ended, before this input "
                            "(404 if not stored for this API key and cache_salt)",
    "store": "served: kept in memory, bounded per API key and cache_salt, oldest evicted "
             "first (server.responses_store_per_key); GET and DELETE /v1/responses/{id}",
    "stream": "served: the typed events of responses.stream()",
    "stream_options": "accepted: deltas are never padded (no obfuscation field)",
    "max_output_tokens": "served", "temperature": "served", "top_p": "served",
    "tools": "served (function tools); hosted tools refused",
    "tool_choice": "served (none, auto, required, a function); allowed_tools and hosted tool "
                   "types refused",
    "parallel_tool_calls": "served",
    "max_tool_calls": "accepted: it limits built-in tool calls, and none run here",
    "text": "format served (text, json_object, json_schema); verbosity refused",
    "include": "'message.output_text.logprobs' served; the other includable fields name "
               "items this server never produces",
    "top_logprobs": "served (with include message.output_text.logprobs)",
    "reasoning": "effort 'none' only: the model does not reason",
    "truncation": "'disabled' only", "metadata": "served: validated, stored and returned",
    "user": "served: written to the server's log with the request id",
    "safety_identifier": "served: written to the server's log with the request id",
    "prompt_cache_key": "accepted: every prompt's prefix is cached whatever its key; a load "
                        "balancer may route on it",
    "prompt_cache_retention": "'in_memory' (what the prefix cache does); '24h' refused",
    "prompt_cache_options": "mode 'implicit' (every prefix is cached); 'explicit' and a ttl "
                            "refused",
    "service_tier": "'auto' or 'default'; the other tiers refused",
    "background": "false only", "background_options": "refused",
    "conversation": "refused: use previous_response_id", "prompt": "refused",
    "context_management": "refused", "moderation": "refused", "image": "refused",
    "access_programs": "refused",
}


# -- to a chat request ---------------------------------------------------------------------

def items_to_messages(items: list) -> list[dict]:
    """Chat messages (ChatMessage dicts) of input items; an answer's function calls join its
    assistant message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        else:
            messages.append({"role": item.role, "content": item.text()})
    return messages


def output_to_messages(output: list[dict]) -> list[dict]:
    """The chat messages of a response's output items (dicts, as the response holds them)."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append(MessageItem(role="assistant", content="".join(
                part.get("text", "") for part in item["content"])))
        elif item["type"] == "function_call":
            items.append(FunctionCallItem(type="function_call", call_id=item["call_id"],
                                          name=item["name"], arguments=item["arguments"]))
    return items_to_messages(items)


# the Responses field of each chat field an error of a translated request may name
_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "logprobs": "include"}


def responses_param(param: str | None) -> str | None:
    """The Responses field of a chat field named by an error."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    if head == "messages":  # instructions, history and input items are one list there
        return "input"
    if head == "tools":  # tools.0.function.name -> tools.0.name
        return param.replace(".function.", ".", 1)
    return _PARAMS.get(head, param)


def as_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest,
                                                                    list[dict]]:
    """(the chat request of `req` after the stored conversation `history`, the chat messages of
    `req`'s own input). A 400 names the Responses field."""
    new = items_to_messages(req.input_items())
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + new
    if not (history or new):
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    body = {
        "model": req.model, "messages": messages, "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"})}
                  for t in req.tools] if req.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": req.tool_choice.name}}
                        if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice),
        "response_format": (req.text.format.as_response_format()
                            if req.text is not None and req.text.format is not None else None),
        "logprobs": req.with_logprobs or None,
        "top_logprobs": req.top_logprobs if req.with_logprobs else None,
        "prediction": req.prediction.model_dump() if req.prediction is not None else None,
        **{name: getattr(req, name) for name in (
            "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "stop", "ignore_eos", "speculative",
            "cache_salt", "user", "safety_identifier")},
    }
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        message, param = describe_validation(exc.errors())
        where = responses_param(param)
        if param is not None and message.startswith(f"{param}: "):
            message = f"{where}: {message[len(param) + 2:]}"
        raise APIError(400, message, where, "invalid_value") from None
    return chat, new
