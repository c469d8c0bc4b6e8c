"""/v1/responses with the official client against a real server on a tiny model: the same
generation as chat (identical tokens at temperature 0), the typed stream `responses.stream()`
consumes, structured output, a function-tool round trip by previous_response_id and by explicit
input items, the store (per API key and cache_salt, bounded), and bad input as OpenAI-shaped
4xx errors. The agent frameworks on it: tests/test_agents.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from server_utils import ServerProcess, save_tiny_model

MODEL = "tiny"
KEY, OTHER_KEY = "key-one", "key-two"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"city": {"type": "string",
                                                 "pattern": "^[A-Za-z]{1,8}$"}}}}]
# a json_schema answer ends by itself on a random model: the grammar closes it
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}


class Answer(BaseModel):
    n: int


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", MODEL, "--device", "cpu",
                         "--num-threads", "1", "--speculative", "ngram", "--k-max", "4"],
                        env={"SPECSERVE_API_KEY": f"{KEY},{OTHER_KEY}"}).wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_text(client, messages, **kw) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content


def test_a_response_is_the_chat_answer_to_the_same_messages(client):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="The quick fox",
                                max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "The quick fox"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=12)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store


def test_the_stream_is_the_typed_event_sequence_of_the_same_response(client):
    kwargs = dict(model=MODEL, input="Count:", temperature=0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == "completed" and json.loads(final.output_text)["n"] >= 0
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id != whole.id


def test_structured_output_through_parse(client):
    parsed = client.responses.parse(model=MODEL, input="A number:", text_format=Answer,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Answer)
    assert parsed.text.format.type == "json_schema"


def test_logprobs_when_included(client):
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    text = r.output[0].content[0]
    assert len(text.logprobs) == 5
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in text.logprobs)
    assert "".join(lp.token for lp in text.logprobs) == text.text
    plain = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5,
                                    temperature=0)
    assert not plain.output[0].content[0].logprobs and plain.output_text == text.text


def _call(client, **kw):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False,
                                temperature=0, max_output_tokens=60, **kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    return r


def test_a_function_tool_round_trip_by_previous_response_id_and_by_items(client):
    first = _call(client)
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    by_id = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                    tools=TOOLS, max_output_tokens=10, temperature=0)
    items = [{"role": "user", "content": "Weather in Paris?"}, *first.output, result]
    by_items = client.responses.create(model=MODEL, input=items, tools=TOOLS,
                                       max_output_tokens=10, temperature=0)
    assert by_id.previous_response_id == first.id
    assert by_id.output_text == by_items.output_text
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    chat = chat_text(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}], max_tokens=10)
    assert by_items.output_text == chat


def test_a_streamed_function_call(client):
    whole = _call(client)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert final.output[0].arguments == whole.output[0].arguments


def test_stored_responses_by_key_and_salt(server, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another key's responses are not there
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as missing:
        other.responses.create(model=MODEL, input="Go on", previous_response_id=r.id)
    assert missing.value.body["param"] == "previous_response_id"
    salted = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                     extra_body={"cache_salt": "s1"})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(salted.id)
    assert client.responses.retrieve(salted.id, extra_query={"cache_salt": "s1"}).id == salted.id
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_the_store_is_bounded_per_partition_and_in_all():
    from server.responses import ResponseStore, Stored

    store = ResponseStore(per_partition=2, total=3)
    for i in range(3):
        store.put(("a", None), Stored({"id": f"a{i}"}, []))
    store.put(("b", None), Stored({"id": "b0"}, []))
    store.put(("b", None), Stored({"id": "b1"}, []))
    with pytest.raises(Exception):
        store.get(("a", None), "a0")  # the partition's oldest, at its bound
    with pytest.raises(Exception):
        store.get(("a", None), "a1")  # the oldest of all, at the total bound
    assert [store.get(p, i).response["id"] for p, i in
            ((("a", None), "a2"), (("b", None), "b0"), (("b", None), "b1"))] == ["a2", "b0", "b1"]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "include": ["nope"]}, "include"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 10 ** 7}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_bad_requests_are_4xx_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error
    if param == "max_output_tokens":
        assert error["message"].startswith("max_output_tokens")


def test_get_refuses_unknown_query_parameters(server, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    got = httpx.get(f"{server.url}/v1/responses/{r.id}?stream=true",
                    headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
