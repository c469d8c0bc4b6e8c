"""The HTTP server as a real subprocess, exercised with the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess, save_tiny_model

MODEL = "tiny"
HELLO = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL,
                         "--device", "cpu", "--num-threads", "1"]).wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(url, body, headers=None):
    """Raw SSE data payloads, to check the wire format the client library hides."""
    events = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/openapi.json").status_code == 200
    assert httpx.get(server.url + "/docs").status_code == 200


def test_stream_and_non_stream_equal_at_temperature_zero(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                          max_tokens=24, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                                 max_tokens=24, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert finals[0].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert all(c.usage is None for c in chunks)


def test_stream_wire_format_and_include_usage(server):
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = sse_events(server.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 8
    assert all(p["usage"] is None for p in payloads[:-1])
    ids = {p["id"] for p in payloads}
    assert len(ids) == 1


def test_n2_streamed_and_not(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=6,
                                          seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=6,
                                                 seed=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].choices[0].delta.role == "assistant"
        assert sum(1 for c in mine if c.choices[0].finish_reason) == 1
        text = "".join(c.choices[0].delta.content or "" for c in mine)
        assert text == full.choices[index].message.content  # same seeds, same tokens


def test_seeds_reproducible(client):
    def run(seed):
        return client.chat.completions.create(model=MODEL, messages=HELLO, temperature=1.0,
                                              max_tokens=16, seed=seed,
                                              extra_body={"ignore_eos": True}
                                              ).choices[0].message.content
    assert run(42) == run(42)
    assert len({run(s) for s in range(5)}) > 1


@pytest.fixture(scope="module")
def ngram_client(model_dir, tmp_path_factory):
    """A server speculating with n-gram drafts and adaptive k (k follows load and timings)."""
    cfg = tmp_path_factory.mktemp("ngram") / "ngram.yaml"
    cfg.write_text(f"engine:\n  model: {model_dir}\n  device: cpu\n  num_threads: 1\n"
                   f"  speculative:\n    method: ngram\n    k_max: 6\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", MODEL]).wait_ready()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.terminate() == 0, srv.log()


def test_seeded_output_is_the_same_with_speculation_on_or_off(ngram_client):
    messages = [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]

    def run(speculative=True, n=1):
        out = ngram_client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, max_tokens=48, seed=1234, n=n,
            extra_body={"ignore_eos": True, "speculative": speculative})
        return [c.message.content for c in out.choices], out.usage

    first, usage = run()
    assert usage.model_extra["speculative"]["drafted_tokens"] > 0  # it did speculate
    assert run()[0] == run()[0] == first
    assert run(speculative=False)[0] == first
    pair, _ = run(n=2)
    assert pair[0] == first[0] and pair[1] != first[0]  # choice 1 has a seed of its own
    assert run(n=2)[0] == pair == run(speculative=False, n=2)[0]


def test_lookahead_from_the_config_file_answers_as_plain_decoding(model_dir, tmp_path):
    """speculative.method lookahead with a lookahead section, through the official client:
    the answer without speculation, the pool's drafts counted under their method."""
    cfg = tmp_path / "lookahead.yaml"
    cfg.write_text(f"engine:\n  model: {model_dir}\n  device: cpu\n  num_threads: 1\n"
                   f"  speculative:\n    method: lookahead\n    adaptive: false\n"
                   f"    lookahead: {{window: 3, ngram: 3, max_candidates: 4}}\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", MODEL]).wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]

        def run(speculative):
            return client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=48,
                extra_body={"ignore_eos": True, "speculative": speculative})

        spec, plain = run(True), run(False)
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert spec.usage.model_extra["speculative"]["methods"]["lookahead"]["drafted_tokens"] > 0
    finally:
        assert srv.terminate() == 0, srv.log()


def test_stop_strings_spanning_tokens_are_cut_and_never_leak(client):
    free = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                          max_tokens=40, extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    assert len(text) > 12
    stop = text[5:11]  # a piece from the middle: spans token boundaries in general
    cut = text[:text.index(stop)]
    out = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                         max_tokens=40, stop=[stop, "zzzz-never"],
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == cut
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                                 max_tokens=40, stop=stop, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_shape(client):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                         max_tokens=5, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top token


def test_completions_endpoint(client):
    out = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=7,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.usage.completion_tokens == 7
    assert len(out.choices[0].logprobs.tokens) == 7
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=7, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == out.choices[0].text


BAD = [
    # (description, body or raw bytes, headers, status, param)
    ("malformed json", b"{not json", None, 400, None),
    ("json array body", b"[1, 2]", None, 400, None),
    ("empty body", b"", None, 400, None),
    ("missing messages", {"model": MODEL}, None, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, None, 400, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages.0.role"),
    ("missing content", {"model": MODEL, "messages": [{"role": "user"}]}, None, 400, "messages.0"),
    ("content wrong type", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None,
     400, "messages.0.content"),
    ("missing model", {"messages": HELLO}, None, 400, "model"),
    ("temperature too high", {"model": MODEL, "messages": HELLO, "temperature": 3}, None, 400,
     "temperature"),
    ("negative temperature", {"model": MODEL, "messages": HELLO, "temperature": -1}, None, 400,
     "temperature"),
    ("top_p zero", {"model": MODEL, "messages": HELLO, "top_p": 0}, None, 400, "top_p"),
    ("n zero", {"model": MODEL, "messages": HELLO, "n": 0}, None, 400, "n"),
    ("n too large", {"model": MODEL, "messages": HELLO, "n": 1000}, None, 400, "n"),
    ("max_tokens zero", {"model": MODEL, "messages": HELLO, "max_tokens": 0}, None, 400,
     "max_tokens"),
    ("huge max_tokens", {"model": MODEL, "messages": HELLO, "max_tokens": 10**7}, None, 400,
     "max_tokens"),
    ("top_logprobs too many", {"model": MODEL, "messages": HELLO, "logprobs": True,
                               "top_logprobs": 21}, None, 400, "top_logprobs"),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": HELLO, "top_logprobs": 2},
     None, 400, None),
    ("five stop strings", {"model": MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]},
     None, 400, "stop"),
    ("presence penalty out of range", {"model": MODEL, "messages": HELLO,
                                       "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("logit_bias bad key", {"model": MODEL, "messages": HELLO, "logit_bias": {"abc": 1}}, None,
     400, "logit_bias"),
    ("logit_bias out of vocab", {"model": MODEL, "messages": HELLO,
                                 "logit_bias": {"99999999": 1}}, None, 400, "logit_bias"),
    ("unknown model", {"model": "gpt-9", "messages": HELLO}, None, 404, "model"),
    ("over-long prompt", {"model": MODEL, "messages": [{"role": "user",
                                                       "content": "fox " * 5000}]}, None, 400,
     "messages"),
    ("wrong content type", b"model=tiny", {"content-type": "text/plain"}, 400, None),
    ("seed not an integer", {"model": MODEL, "messages": HELLO, "seed": "abc"}, None, 400, "seed"),
    ("completion empty prompt", {"model": MODEL, "prompt": ""}, None, 400, "prompt"),
    ("completion echo", {"model": MODEL, "prompt": "hi", "echo": True}, None, 400, "echo"),
    ("stop string too long", {"model": MODEL, "messages": HELLO, "stop": "x" * 5000}, None, 400,
     "stop"),
]


@pytest.mark.parametrize("name, body, headers, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, body, headers, status, param):
    path = "/v1/completions" if "completion" in name else "/v1/chat/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"] and "/" not in err["message"]
    assert "Value error" not in err["message"]
    if param is not None:
        assert err["param"] == param


ENGINE_REFUSALS = [
    # (path, body, param, code): the engine's InvalidRequestError, its "prompt" renamed
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 5000}]},
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "fox " * 5000}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": HELLO, "logit_bias": {"99999": 1}}, "logit_bias",
     "invalid_value"),
]


@pytest.mark.parametrize("path, body, param, code", ENGINE_REFUSALS)
def test_engine_refusals_name_the_endpoint_field(server, path, body, param, code):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


def test_unknown_route_and_method_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_body_too_large(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"x" * (5 << 20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: the limit is found while the body is read
        for _ in range(6):
            yield b"x" * (1 << 20)

    r = httpx.post(server.url + "/v1/chat/completions", content=chunked(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_serves_normally_after_bad_inputs(client):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert out.choices[0].message.content is not None


def test_request_id_echo(server):
    r = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.url + "/v1/models")
    assert len(r.headers["x-request-id"]) == 32


def test_probes_are_logged_at_debug(caplog):
    """A probe every few seconds must not bury the requests in the access log at INFO."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import AppConfig
    from server.state import ServerState

    http = TestClient(create_app(ServerState(AppConfig())))  # no lifespan: nothing is loaded
    with caplog.at_level(logging.DEBUG, logger="specserve.access"):
        for path in ("/health", "/ready", "/metrics", "/v1/models"):
            http.get(path)
    levels = {r.getMessage().split()[2]: r.levelno for r in caplog.records
              if r.name == "specserve.access"}
    assert levels == {"/health": logging.DEBUG, "/ready": logging.DEBUG,
                      "/metrics": logging.DEBUG, "/v1/models": logging.INFO}


def test_requests_sharing_a_request_id_do_not_collide(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "ignore_eos": True}

    async def one():
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(server.url + "/v1/chat/completions", json=body,
                                   headers={"X-Request-Id": "same"})

    async def main():
        return await asyncio.gather(one(), one(), one())

    rs = asyncio.run(main())
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in rs)
    assert len({r.json()["id"] for r in rs}) == 3


def test_top_k_beyond_the_vocabulary_means_the_whole_vocabulary(client):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                         extra_body={"top_k": 2 ** 63 - 1, "ignore_eos": True})
    assert out.usage.completion_tokens == 4


def _metric(server, name):
    text = httpx.get(server.url + "/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values)


def test_disconnect_of_8_streams_frees_all_blocks(server):
    async def open_and_drop():
        async with httpx.AsyncClient(timeout=30) as ac:
            body = {"model": MODEL, "messages": HELLO, "max_tokens": 900, "stream": True,
                    "ignore_eos": True}
            async with ac.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content": "' in line:
                        return  # leave after the first content chunk: the client disconnects

    async def main():
        await asyncio.gather(*[open_and_drop() for _ in range(8)])

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (_metric(server, "specserve:num_requests_running") == 0
                and _metric(server, "specserve:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.1)
    assert _metric(server, "specserve:num_requests_running") == 0
    assert _metric(server, "specserve:kv_cache_usage_perc") == 0


def test_non_streamed_disconnect_aborts(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metric(server, "specserve:num_requests_running"):
        time.sleep(0.1)
    assert _metric(server, "specserve:kv_cache_usage_perc") == 0


# -- servers with their own settings -------------------------------------------------------

def test_auth(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--device",
                         "cpu", "--api-key", "k1"], env={"SPECSERVE_API_KEY": "k2,k3"})
    try:
        srv.wait_ready()
        url = srv.url + "/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url).json()["error"]["type"] == "authentication_error"
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Basic k1"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer k1"}).status_code == 200
        # flags override the environment: k2 is not accepted
        assert httpx.get(url, headers={"Authorization": "Bearer k2"}).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        # /metrics is behind the key: prefix-cache counters are a side channel across tenants
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics",
                         headers={"Authorization": "Bearer k1"}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k1", max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0
                          ).models.list()
    finally:
        assert srv.terminate() == 0


def test_queue_full_gets_429_with_retry_after(model_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  max_waiting_requests: 1\nengine:\n  max_num_seqs: 1\n")
    srv = ServerProcess(["--config", str(cfg), "--model", str(model_dir), "--served-model-name",
                         MODEL, "--device", "cpu"])
    try:
        srv.wait_ready()

        async def one(ac):
            body = {"model": MODEL, "messages": HELLO, "max_tokens": 300, "ignore_eos": True}
            r = await ac.post(srv.url + "/v1/chat/completions", json=body)
            return r.status_code, r.headers.get("retry-after"), r.json()

        async def main():  # one runs and one waits (300 tokens each): slow on a busy CPU
            async with httpx.AsyncClient(timeout=300) as ac:
                return await asyncio.gather(*[one(ac) for _ in range(6)])

        results = asyncio.run(main())
        codes = [code for code, _, _ in results]
        assert 200 in codes and 429 in codes, codes
        for code, retry_after, body in results:
            if code == 429:
                assert retry_after == "1" and body["error"]["type"] == "rate_limit_error"
    finally:
        assert srv.terminate() == 0


def test_sigterm_lets_streams_finish_and_exits_zero(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--device",
                         "cpu", "--drain-timeout", "60"]).wait_ready()
    n_tokens = 400

    async def stream(ac, seen):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": n_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        finish, usage_tokens, done = None, None, False
        async with ac.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                payload = json.loads(data)
                seen.append(1)
                if payload["choices"] and payload["choices"][0]["finish_reason"]:
                    finish = payload["choices"][0]["finish_reason"]
                if payload.get("usage"):
                    usage_tokens = payload["usage"]["completion_tokens"]
        return finish, usage_tokens, done

    async def main():
        seen = []
        async with httpx.AsyncClient(timeout=120) as ac:
            tasks = [asyncio.create_task(stream(ac, seen)) for _ in range(4)]
            while len(seen) < 8:  # all four streams are flowing
                await asyncio.sleep(0.01)
            srv.proc.send_signal(15)
            await asyncio.sleep(0.2)
            during = await ac.post(srv.url + "/v1/chat/completions",
                                   json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
            ready = await ac.get(srv.url + "/ready")
            results = await asyncio.gather(*tasks)
        return results, during, ready

    results, during, ready = asyncio.run(main())
    assert during.status_code == 503 and during.json()["error"]["code"] == "draining"
    assert ready.status_code == 503
    assert results == [("length", n_tokens, True)] * 4
    assert srv.proc.wait(30) == 0
    srv.terminate()


def test_drain_timeout_aborts_with_an_error_event_then_done(model_dir):
    """Streams still running at the drain deadline end with data: {"error"} and [DONE]."""
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--device",
                         "cpu", "--drain-timeout", "0.5"]).wait_ready()
    events = []
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 50000 // 60, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    srv.proc.send_signal(15)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "aborted" and error["type"] == "service_unavailable"
    assert srv.proc.wait(30) == 0
    srv.terminate()


def _schema_for_fuzzing(server, path):
    """Our /openapi.json, with `model` pinned to the served one (so requests reach generation)
    and max_tokens (max_output_tokens) and n kept small (so the run fits in CI)."""
    schema = httpx.get(server.url + "/openapi.json").json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = schema["components"]["schemas"][name]
        props = body["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        props.pop("max_completion_tokens", None)
        body["required"] = sorted(set(body.get("required", [])) | {"max_tokens"})
    body = schema["components"]["schemas"]["ResponsesRequest"]
    body["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    body["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
    body["required"] = sorted(set(body.get("required", [])) | {"max_output_tokens"})
    path.write_text(json.dumps(schema))
    return path


def test_schemathesis_no_server_errors(server, tmp_path):
    """Property-based requests from our own OpenAPI schema: never a 5xx."""
    import subprocess
    import sys

    schema = _schema_for_fuzzing(server, tmp_path / "openapi.json")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", str(schema), "--url", server.url,
           "--checks", "not_a_server_error", "--max-examples", "30",
           "--include-path-regex", "^/v1/((chat/)?completions|responses)$", "--no-color",
           "--seed", "1", "--request-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout.split("SUMMARY")[-1]
