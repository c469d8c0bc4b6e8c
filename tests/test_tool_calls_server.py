"""Tool calling through the HTTP API with the official `openai` client, on a tiny model trained
to write what agents' models write: a fenced JSON call under `auto`, a call repeated in a loop,
two calls at once, a text answer after a tool result. Speculation (n-gram) is on."""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import openai_client, save_scripted_tiny_model, tiny_server

MODEL = "scripted"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def call(name, **args):
    return json.dumps({"name": name, "arguments": args})


def tag(text):
    return f"<tool_call>\n{text}\n</tool_call>"


def ask(question):
    return [{"role": "user", "content": question}]


PARIS = ask("What is the weather in Paris?")
ROUND_TRIP = PARIS + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
OSLO = ask("Weather in Oslo?")  # the model loops: the same call four times
ROME = ask("Weather in Rome and the time in UTC?")  # two different calls
SCRIPTS = [
    (PARIS, "```json\n" + call("get_weather", city="Paris") + "\n```"),
    (ROUND_TRIP, "It is 21 C in Paris."),
    (OSLO, "\n".join([tag(call("get_weather", city="Oslo"))] * 4)),
    (ROME, tag(call("get_weather", city="Rome")) + "\n" + tag(call("get_time", zone="UTC"))),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_scripted_tiny_model(
        tmp_path_factory.mktemp("scripted-model"),
        [({"model": MODEL, "messages": messages, "tools": TOOLS}, reply)
         for messages, reply in SCRIPTS], steps=150)
    with tiny_server(model_dir, MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


def chat(client, messages, **kw):
    room = 60 if messages is ROUND_TRIP else 200  # the tiny model's context is 1024 tokens
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          temperature=0, max_tokens=room, **kw)


def streamed(client, messages, **kw) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index, finish reason) of a streamed answer; each call must arrive
    whole in one delta."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, messages, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            assert tc.index not in calls and tc.id.startswith("call_")
            calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
        finish = choice.finish_reason or finish
    return content, calls, finish


def names_and_args(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_auto_turns_a_fenced_json_call_into_tool_calls(client):
    out = chat(client, PARIS)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    assert names_and_args(message.tool_calls) == [("get_weather", {"city": "Paris"})]
    content, calls, finish = streamed(client, PARIS)
    assert (content, finish) == ("", "tool_calls")
    arguments = message.tool_calls[0].function.arguments
    assert calls == {0: {"name": "get_weather", "arguments": arguments}}


def test_a_text_answer_after_the_tool_result(client):
    out = chat(client, ROUND_TRIP)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == "It is 21 C in Paris."
    assert not out.choices[0].message.tool_calls
    content, calls, finish = streamed(client, ROUND_TRIP)
    assert (content, calls, finish) == ("It is 21 C in Paris.", {}, "stop")


@pytest.mark.parametrize("choice", ["required", "auto",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_a_model_that_repeats_its_call_gets_one_call_and_the_turn_ends(client, choice):
    out = chat(client, OSLO, tool_choice=choice)
    assert out.choices[0].finish_reason == "tool_calls"
    assert names_and_args(out.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    one_call = len(chat(client, OSLO, tool_choice=choice, parallel_tool_calls=False)
                   .choices[0].message.tool_calls)
    assert one_call == 1
    # the second, identical call ended the turn: far fewer tokens than the loop's four calls
    loop_tokens = out.usage.completion_tokens
    single = chat(client, ROME, tool_choice=choice, parallel_tool_calls=False)
    assert loop_tokens < 3 * single.usage.completion_tokens
    _, calls, finish = streamed(client, OSLO, tool_choice=choice)
    assert finish == "tool_calls" and len(calls) == 1


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_tool_calls_true_and_false(client, choice):
    both = chat(client, ROME, tool_choice=choice)
    assert both.choices[0].finish_reason == "tool_calls"
    assert names_and_args(both.choices[0].message.tool_calls) == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "UTC"})]
    _, calls, finish = streamed(client, ROME, tool_choice=choice)
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == [
        "get_weather", "get_time"] and list(calls) == [0, 1]
    one = chat(client, ROME, tool_choice=choice, parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls"
    assert names_and_args(one.choices[0].message.tool_calls) == [("get_weather", {"city": "Rome"})]


def test_speculation_off_gives_the_same_answers(client):
    for messages in (PARIS, OSLO, ROME, ROUND_TRIP):
        on, off = (chat(client, messages, extra_body={"speculative": spec}).choices[0].message
                   for spec in (True, False))
        assert on.content == off.content
        assert [c.function.model_dump() for c in on.tool_calls or []] == [
            c.function.model_dump() for c in off.tool_calls or []]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools"),  # auto compiles the schemas too
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools"),
    ({"tools": [WEATHER], "messages": PARIS + [
        {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}]},
     "messages.1.tool_call_id"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": PARIS, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
