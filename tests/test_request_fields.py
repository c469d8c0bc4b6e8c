"""Every field the official `openai` client can send is decided: served, or refused with a 400
that names it (never silently ignored); an unknown field is a 400 too. Walks the installed
client's own parameter lists, so a field a newer client adds fails here until it is decided."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import openai
import pytest
from openai.resources.responses import Responses
from server_utils import ServerProcess, save_tiny_model

from server.protocol import (CHAT_FIELDS, CLIENT_ONLY, COMPLETION_FIELDS, ChatCompletionRequest,
                             CompletionRequest)
from server.responses_protocol import RESPONSES_FIELDS, ResponsesRequest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
HELLO = [{"role": "user", "content": "The quick brown fox"}]


def client_fields(create) -> set[str]:
    names = set(inspect.signature(create).parameters) - {"self"}
    return names - set(CLIENT_ONLY)


@pytest.mark.parametrize("create, table, model", [
    (openai.resources.chat.completions.Completions.create, CHAT_FIELDS, ChatCompletionRequest),
    (openai.resources.completions.Completions.create, COMPLETION_FIELDS, CompletionRequest),
    (Responses.create, RESPONSES_FIELDS, ResponsesRequest),
], ids=["chat", "completions", "responses"])
def test_every_field_of_the_client_is_decided_and_documented(create, table, model):
    fields = client_fields(create)
    assert fields - set(table) == set(), "fields the client sends that nobody decided"
    assert set(table) - fields == set(), "decided fields the client no longer has"
    assert fields <= set(model.model_fields), "a decided field the request model lacks"
    documented = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs/serving.md").read_text(),
                                re.MULTILINE))
    assert fields <= documented, f"not in docs/serving.md's table: {fields - documented}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    srv = ServerProcess(["--model", str(folder), "--served-model-name", MODEL,
                         "--device", "cpu", "--num-threads", "1"]).wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


REFUSED_CHAT = [  # (keyword arguments of chat.completions.create, the param the 400 names)
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "30m"}}, "prompt_cache_options.ttl"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"extra_body": {"best_of_luck": 1}}, "best_of_luck"),
]


@pytest.mark.parametrize("kwargs, param", REFUSED_CHAT, ids=[p for _, p in REFUSED_CHAT])
def test_chat_fields_not_served_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **kwargs)
    err = caught.value.body
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"best_of": 2}, "best_of"), ({"suffix": "return x"}, "suffix"), ({"echo": True}, "echo"),
    ({"extra_body": {"mystery": True}}, "mystery"),
], ids=["best_of", "suffix", "echo", "unknown"])
def test_completion_fields_not_served_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body


def test_served_and_accepted_fields_leave_the_answer_as_it_is(server, client):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                           temperature=0)
    decided = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, store=False,
        service_tier="auto", modalities=["text"], reasoning_effort="none",
        metadata={"team": "search"}, prompt_cache_key="conversation-7",
        prompt_cache_retention="in_memory", prompt_cache_options={"mode": "implicit"},
        safety_identifier="hashed-user-42", user="user-42")
    assert decided.choices[0].message.content == plain.choices[0].message.content
    log = server.log()
    assert "safety_identifier='hashed-user-42'" in log and "user='user-42'" in log
    first = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6,
                                      temperature=0)
    same = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6,
                                     temperature=0, best_of=1, suffix="")
    assert same.choices[0].text == first.choices[0].text


REFUSED_RESPONSES = [  # (keyword arguments of responses.create, the param the 400 names)
    ({"background": True}, "background"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_123"}}, "prompt"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
     "context_management"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"reasoning": {"effort": "medium"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"include": ["message.output_text.everything"]}, "include"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0"),
    ({"extra_body": {"n": 2}}, "n"),
]


@pytest.mark.parametrize("kwargs, param", REFUSED_RESPONSES,
                         ids=[p for _, p in REFUSED_RESPONSES])
def test_responses_fields_not_served_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="The quick", max_output_tokens=4, **kwargs)
    err = caught.value.body
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_accepted_responses_fields_leave_the_answer_as_it_is(server, client):
    plain = client.responses.create(model=MODEL, input="The quick", max_output_tokens=6,
                                    temperature=0)
    decided = client.responses.create(
        model=MODEL, input="The quick", max_output_tokens=6, temperature=0, store=False,
        service_tier="auto", reasoning={"effort": "none"}, truncation="disabled",
        metadata={"team": "search"}, prompt_cache_key="conversation-7",
        prompt_cache_retention="in_memory", prompt_cache_options={"mode": "implicit"},
        include=["reasoning.encrypted_content"], max_tool_calls=3, background=False,
        safety_identifier="hashed-user-43", user="user-43")
    assert decided.output_text == plain.output_text
    assert decided.metadata == {"team": "search"} and decided.store is False
    log = server.log()
    assert "safety_identifier='hashed-user-43'" in log and "user='user-43'" in log
