"""Pydantic models of the OpenAI API subset we serve. Must not touch the engine.

Requests are validated here (ranges, shapes). Every field of a request body is either served
or refused with a 400 that names it: an unknown top-level field is refused as OpenAI refuses it
("unrecognized request argument"), and each field the official client sends is decided in
`CHAT_FIELDS` / `COMPLETION_FIELDS` (what we do with it; docs/serving.md shows the same table).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    arguments: str = "{}"  # a JSON object, as a string


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def as_dict(self) -> dict:
        """The message for a chat template (developer is system to the model)."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name and self.role == "tool":
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_STOP_CHARS = 1000  # each step looks for every prefix of every stop string


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Union[dict, bool, None] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


def _refused(value, why: str):
    """A field we do not serve: null (or absent) only."""
    if value is not None:
        raise ValueError(why)
    return value


def refused_fields(reasons: dict[str, str]):
    """One validator of a request model that refuses each field of `reasons` unless null,
    saying why (assign it to a name in the class body)."""
    def check(cls, value, info):
        return _refused(value, reasons[info.field_name])

    return field_validator(*reasons)(classmethod(check))


def _only(value, allowed: tuple, why: str):
    if value is not None and value not in allowed:
        raise ValueError(f"{value!r} is not served; {why}")
    return value


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_IDENTIFIER = 1024  # user, safety_identifier, prompt_cache_key


def check_metadata(value: dict | None) -> dict | None:
    """OpenAI's limits of `metadata`."""
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
            raise ValueError(f"keys of at most {MAX_METADATA_KEY} characters and values "
                             f"of at most {MAX_METADATA_VALUE}")
    return value


class PromptCacheOptions(_Request):
    model_config = ConfigDict(extra="forbid")
    mode: Optional[str] = None
    ttl: Optional[str] = None

    @field_validator("mode")
    @classmethod
    def _implicit(cls, value):
        return _only(value, ("implicit",), "every prompt's prefix is cached, without "
                     "breakpoints: only 'implicit'")

    @field_validator("ttl")
    @classmethod
    def _no_ttl(cls, value):
        return _refused(value, "no minimum lifetime is promised: cached blocks are evicted "
                               "when memory is needed")


MAX_PREDICTION_CHARS = 1_000_000  # (its tokens are bounded by the context: validation.py)


class Prediction(_Request):
    """Predicted Outputs: the text the answer is expected to be, mostly (e.g. the file being
    edited); the server drafts from it and verifies every draft, so the answer is what it
    would be without it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @model_validator(mode="after")
    def _bounded(self) -> "Prediction":
        if len(self.text()) > MAX_PREDICTION_CHARS:
            raise ValueError(f"a prediction of at most {MAX_PREDICTION_CHARS} characters")
        return self


class _SamplingFields(_Request):
    model_config = ConfigDict(extra="forbid")  # an unknown argument is a 400 naming it
    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extra, as in vLLM
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extra
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # extra
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=-(2 ** 63), lt=2 ** 63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    # an end user's identifier: written to the server's log with the request id
    user: Optional[str] = Field(default=None, max_length=MAX_IDENTIFIER)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    speculative: Optional[bool] = None  # extra: false opts this request out of speculation
    ignore_eos: bool = False  # extra
    # Predicted Outputs (an extra on /v1/completions)
    prediction: Optional[Prediction] = None
    # extra, as in vLLM: requests share prefix-cache blocks only with equal salts
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)
    # structured output: OpenAI's response_format, and vLLM's guided_regex / guided_choice
    response_format: Optional[ResponseFormat] = None
    guided_regex: Optional[str] = Field(default=None, min_length=1)
    guided_choice: Optional[list[str]] = Field(default=None, min_length=1)

    @field_validator("guided_choice")
    @classmethod
    def _check_choices(cls, value):
        if value is not None and any(not c for c in value):
            raise ValueError("guided_choice options must be non-empty strings")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        if value is None:
            return None
        out = {}
        for key, bias in value.items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
            out[int(key)] = float(bias)
        return out


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None  # calls enforced by tool_choice always follow the schema


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class AccountFields(BaseModel):
    """Fields of chat completions and responses alike: who asks, the prompt cache's hints,
    metadata, the service tier (see CHAT_FIELDS)."""

    safety_identifier: Optional[str] = Field(default=None, max_length=MAX_IDENTIFIER)
    prompt_cache_key: Optional[str] = Field(default=None, max_length=MAX_IDENTIFIER)
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None

    @field_validator("service_tier")
    @classmethod
    def _check_tier(cls, value):
        return _only(value, ("auto", "default"), "one tier is served: 'auto' or 'default'")

    @field_validator("prompt_cache_retention")
    @classmethod
    def _check_retention(cls, value):
        return _only(value, ("in_memory", "in-memory"), "the prefix cache lives in memory "
                     "(evicted when blocks are needed): only 'in_memory'")

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value):
        return check_metadata(value)


class ChatCompletionRequest(_SamplingFields, AccountFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # decided fields of OpenAI's chat completions beyond sampling (see CHAT_FIELDS)
    store: Optional[bool] = None
    modalities: Optional[list[str]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    audio: Optional[dict] = None
    web_search_options: Optional[dict] = None
    moderation: Optional[dict] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # the deprecated forms of tools: refused, naming the field, rather than ignored
    functions: Optional[list] = None
    function_call: Union[str, dict, None] = None

    _unserved = refused_fields({
        "functions": "deprecated: use tools and tool_choice",
        "function_call": "deprecated: use tools and tool_choice",
        "audio": "audio output is not served: this server generates text",
        "web_search_options": "web search is not served: the model answers from its prompt",
        "moderation": "moderation is not served: no moderation model runs here",
        "verbosity": "verbosity is not served: the model's answer length follows the prompt "
                     "and max_completion_tokens"})

    @field_validator("store")
    @classmethod
    def _no_store(cls, value):
        if value:
            raise ValueError("chat completions are not stored here: store must be false")
        return value

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value):
        if value is not None and any(m != "text" for m in value):
            raise ValueError("only the text modality is served")
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _check_reasoning(cls, value):
        return _only(value, ("none",), "the served model does not reason: only 'none'")

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:  # (an empty suffix is no suffix)
            raise ValueError("suffix (text inserted after the completion) is not served")
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value, info):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not served: every generated choice is "
                             "returned")
        return value

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(v, list) and not v for v in value):
            raise ValueError("prompt token lists must not be empty")
        return value


# What each field of the official client's create calls does here (openai 3.57; a field a
# later client adds fails tests/test_request_fields.py until it is decided): "served" fields
# act as OpenAI documents; the rest say what they do or when they are refused (a 400 naming
# the field). docs/serving.md shows the same table.
_SHARED_FIELDS = {
    "model": "served: must name the served model (else 404)",
    "frequency_penalty": "served", "presence_penalty": "served", "logit_bias": "served",
    "max_tokens": "served", "n": "served", "seed": "served: reproducible per seed",
    "stop": "served (at most 4)", "stream": "served", "stream_options": "served",
    "temperature": "served", "top_p": "served",
    "user": "served: written to the server's log with the request id",
}
CHAT_FIELDS = {
    **_SHARED_FIELDS,
    "messages": "served (text content; image, audio and file parts are refused)",
    "logprobs": "served", "top_logprobs": "served",
    "max_completion_tokens": "served",
    "tools": "served (function tools)", "tool_choice": "served", "parallel_tool_calls": "served",
    "response_format": "served (text, json_object, json_schema)",
    "functions": "refused: deprecated, use tools", "function_call": "refused: use tool_choice",
    "safety_identifier": "served: written to the server's log with the request id",
    "prompt_cache_key": "accepted: every prompt's prefix is cached whatever its key; a load "
                        "balancer may route on it",
    "prompt_cache_retention": "'in_memory' (what the prefix cache does); '24h' refused",
    "prompt_cache_options": "mode 'implicit' (every prefix is cached); 'explicit' and a ttl "
                            "refused",
    "metadata": "validated (16 pairs, 64/512 characters) and not stored, as with store false",
    "store": "false only: completions are not stored",
    "service_tier": "'auto' or 'default'; the other tiers refused",
    "modalities": "['text'] only", "reasoning_effort": "'none' only: the model does not reason",
    "verbosity": "refused", "audio": "refused", "web_search_options": "refused",
    "moderation": "refused",
    "prediction": "served: drafts from the predicted text, verified (the answer does not "
                  "depend on it); usage.completion_tokens_details counts its tokens",
}
COMPLETION_FIELDS = {
    **_SHARED_FIELDS,
    "prompt": "served (text, texts, token ids, lists of token ids)",
    "logprobs": "served (up to 5)", "echo": "false only", "suffix": "empty only",
    "best_of": "equal to n only: every generated choice is returned",
}
# the client's own arguments, never sent in the body
CLIENT_ONLY = ("extra_headers", "extra_query", "extra_body", "timeout")


# -- responses -----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
