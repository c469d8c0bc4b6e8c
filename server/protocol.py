"""Pydantic models of the OpenAI API subset we serve. Must not touch the engine.

Requests are validated here (ranges, shapes); unknown fields are ignored, as OpenAI does.
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


class _SamplingFields(_Request):
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
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    speculative: Optional[bool] = None  # extra: false opts this request out of speculation
    ignore_eos: bool = False  # extra
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # the deprecated forms of tools: refused, naming the field, rather than ignored
    functions: Optional[list] = None
    function_call: Union[str, dict, None] = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value):
        if value is not None:
            raise ValueError("deprecated: use tools and tool_choice")
        return value

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
