"""Structured output through the HTTP API: the official `openai` client and LangChain."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_utils import openai_client, save_tiny_model, tiny_server

MODEL = "tiny"
ASK = [{"role": "user", "content": "Describe a point."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["dot", "cross"]},
        "coords": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                   "minItems": 2, "maxItems": 2},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False},
    },
    "required": ["label", "kind", "coords", "meta"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA,
                                                 "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    with tiny_server(model_dir, MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_chat_streamed_and_not(client, temperature):
    kw = {"model": MODEL, "messages": ASK, "temperature": temperature, "max_tokens": 200,
          "response_format": FORMAT, "seed": 7}
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy, or seeded: the same answer


def test_json_object_on_completions_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=200,
                                    temperature=0, extra_body={"response_format": {
                                        "type": "json_object"}})
    if out.choices[0].finish_reason == "stop":  # an object may be longer than max_tokens
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:
        assert out.choices[0].text.startswith("{")
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                          response_format={"type": "text"})
    assert chat.choices[0].message.content is not None


def test_parse_with_a_pydantic_model(client):
    """The client's own structured-output helper: a pydantic model in, a parsed object out."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        label: str = Field(max_length=10)
        kind: Literal["dot", "cross"]

    out = client.chat.completions.parse(model=MODEL, messages=ASK, temperature=0,
                                        max_tokens=120, response_format=Point)
    assert isinstance(out.choices[0].message.parsed, Point)


def test_guided_choice_and_regex(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, n=3,
                                         temperature=1.0,
                                         extra_body={"guided_choice": ["red", "green"]})
    assert {c.message.content for c in out.choices} <= {"red", "green"}
    out = client.completions.create(model=MODEL, prompt="Year:", max_tokens=10,
                                    extra_body={"guided_regex": "(19|20)[0-9]{2}"})
    assert out.choices[0].text[:2] in ("19", "20") and len(out.choices[0].text) == 4


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_structured_output_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_metrics_count_grammar_requests(server, client):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                   response_format={"type": "json_object"})
    text = httpx.get(server.url + "/metrics").text
    count = [line for line in text.splitlines()
             if line.startswith("specserve:structured_output_requests_total")]
    assert count and float(count[0].split()[-1]) >= 1
    assert "specserve:structured_output_mask_seconds_total" in text


def test_langchain_with_structured_output_json_schema(server):
    """A real third-party client: LangChain's ChatOpenAI against the server."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        label: str = Field(max_length=10)
        kind: Literal["dot", "cross"]

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused",
                     temperature=0, max_tokens=120, max_retries=0)
    result = llm.with_structured_output(Point, method="json_schema").invoke(
        "Describe a point.")
    assert isinstance(result, Point)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_enforced_tool_call_is_valid_streamed_or_not(client, choice):
    kw = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME],
          "tool_choice": choice, "parallel_tool_calls": False, "temperature": 0,
          "max_tokens": 150}
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    _check_call(message.tool_calls[0], None if choice == "required" else "get_time")
    # streamed: the deltas reassemble to the same call
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": message.tool_calls[0].function.name,
                         "arguments": message.tool_calls[0].function.arguments}}


def test_auto_may_answer_in_text_and_a_tool_result_turn_works(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                         tool_choice="auto", max_tokens=16, temperature=0)
    message = out.choices[0].message
    if message.tool_calls:  # the model chose to call
        _check_call(message.tool_calls[0])
    else:
        assert isinstance(message.content, str)
        assert out.choices[0].finish_reason in ("stop", "length")
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_forced_call_with_a_response_format_is_a_call(client):
    """As on OpenAI: response_format shapes the text of an answer; a turn that must call has
    none, so the call is written (agents force a tool before a structured final answer)."""
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                         tool_choice="required", max_tokens=150, temperature=0,
                                         parallel_tool_calls=False,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "tool_calls"
    _check_call(out.choices[0].message.tool_calls[0])


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_message_without_its_call_id_is_400(server):
    messages = ASK_WEATHER + [{"role": "tool", "content": "21"}]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.1")


def test_langchain_function_calling_and_bind_tools(server):
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        """A point on a map."""

        label: str = Field(max_length=10)
        kind: Literal["dot", "cross"]

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=12)  # bounded: a random model never stops a string

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused",
                     temperature=0, max_tokens=120, max_retries=0)
    # strict: LangChain closes the schema (additionalProperties false), or a random model may
    # add keys until max_tokens
    point = llm.with_structured_output(Point, method="function_calling", strict=True).invoke(
        "Describe a point.")
    assert isinstance(point, Point)
    message = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).invoke(
        "Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "GetWeather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
