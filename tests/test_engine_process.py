"""`server.engine_process: true`: the engine in a process of its own serves what the engine in
the server's thread serves, token for token, with the same validation and metrics."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_utils import ServerProcess, openai_client, save_tiny_model

MODEL = "tiny"
ASK = [{"role": "user", "content": "Describe a point."}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["x", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--device", "cpu",
            "--num-threads", "1", "--speculative", "ngram", "--k-max", "4"]
    started = [ServerProcess(args + ["--no-engine-process"]),
               ServerProcess(args + ["--engine-process"])]
    try:
        yield [srv.wait_ready() for srv in started]
    finally:
        for srv in started:
            assert srv.terminate() == 0, srv.log()


def _both(servers, **body):
    return [openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, **body)
            for srv in servers]


def test_same_tokens_greedy_seeded_and_logprobs(servers):
    for body in ({"temperature": 0, "max_tokens": 24},
                 {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 16},
                 {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}):
        thread, process = _both(servers, **body)
        assert ([c.message.content for c in thread.choices]
                == [c.message.content for c in process.choices])
        assert thread.usage.completion_tokens == process.usage.completion_tokens
        if body.get("logprobs"):
            assert (thread.choices[0].logprobs.model_dump()
                    == process.choices[0].logprobs.model_dump())
    streamed = openai_client(servers[1]).chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=24, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == _both(servers, temperature=0, max_tokens=24)[0].choices[0].message.content


def test_structured_output_and_its_validation(servers):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                  "strict": True}}
    thread, process = _both(servers, temperature=0.7, seed=3, max_tokens=60,
                            response_format=fmt)
    jsonschema.validate(json.loads(process.choices[0].message.content), SCHEMA)
    assert thread.choices[0].message.content == process.choices[0].message.content
    url = servers[1].url + "/v1/chat/completions"
    bad = httpx.post(url, json={"model": MODEL, "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    long = httpx.post(url, json={"model": MODEL, "messages": ASK, "max_tokens": 10 ** 6})
    assert long.status_code == 400 and long.json()["error"]["param"] == "max_tokens"


def test_metrics_come_from_the_engine_process(servers):
    _both(servers, temperature=0, max_tokens=5)
    text = httpx.get(servers[1].url + "/metrics").text
    tokens = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("specserve:generation_tokens_total")]
    assert tokens and tokens[0] > 0
    assert 'engine_model="' in text and "specserve:spec_decode_num_draft_tokens_total{method=" in text
