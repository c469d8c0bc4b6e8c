"""A real server probed as another tenant, a careless client and a slow attacker would: prefix
cache isolation between API keys, /metrics off the public port, HTTP limits and timeouts,
admission under bursts, sampling values float32 cannot represent."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import httpx
import pytest
from server_utils import CHATML, ServerProcess, free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def prefill_model_dir(tmp_path_factory) -> Path:
    """A small model whose prefill of ~1,000 tokens takes long enough to time (~0.2 s here)."""
    import torch
    from conftest import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    tok.chat_template = CHATML
    config = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("prefill-model")
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _complete(url: str, key: str, prompt: list[int], salt: str | None = None):
    """(seconds to the answer of a 1-token completion, prompt tokens the engine served from
    the prefix cache)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return time.perf_counter() - started, r.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def test_tenants_never_share_the_prefix_cache(prefill_model_dir, tmp_path):
    metrics_port = free_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"server:\n  metrics_port: {metrics_port}\n")
    srv = ServerProcess(["--config", str(cfg), "--model", str(prefill_model_dir),
                         "--served-model-name", MODEL, "--device", "cpu", "--num-threads", "1",
                         "--api-key", "key-a", "--api-key", "key-b", "--api-key", "key-c"]).wait_ready()
    rng = random.Random(0)
    times: dict[str, list[float]] = {"fresh": [], "b_exact": [], "c_half": [], "a_again": []}
    try:
        for _ in range(5):
            prompt = [rng.randrange(2, 300) for _ in range(1200)]
            # a partial repeat, by a third tenant
            half = prompt[:600] + [rng.randrange(2, 300) for _ in range(600)]
            for name, key, ids in (("fresh", "key-a", prompt), ("b_exact", "key-b", prompt),
                                   ("c_half", "key-c", half), ("a_again", "key-a", prompt)):
                seconds, cached = _complete(srv.url, key, ids)
                times[name].append(seconds)
                if name == "a_again":
                    assert cached >= 1184  # the same tenant still hits (all full blocks)
                else:
                    assert cached == 0, (name, cached)  # counted by the engine
        median = {name: statistics.median(t) for name, t in times.items()}
        # the measurement can see an advantage (the same tenant's repeat is much faster) ...
        assert median["a_again"] < 0.8 * median["fresh"], median
        # ... and another tenant gets none, exact or partial repeat (noise margin: 25%)
        assert median["b_exact"] > 0.75 * median["fresh"], median
        assert median["c_half"] > 0.75 * median["fresh"], median

        # an explicit salt the tenants share shares the cache, on purpose
        shared = [rng.randrange(2, 300) for _ in range(200)]
        assert _complete(srv.url, "key-a", shared, salt="team")[1] == 0
        assert _complete(srv.url, "key-b", shared, salt="team")[1] >= 192
        assert _complete(srv.url, "key-b", shared)[1] == 0  # b's own partition: no

        # /metrics is not on the API port at all; the metrics port has it, without a key
        assert httpx.get(srv.url + "/metrics",
                         headers={"Authorization": "Bearer key-a"}).status_code == 404
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200 and "prefix_cache_hits" in scraped.text
    finally:
        assert srv.terminate() == 0


def test_cache_salt_is_validated(prefill_model_dir):
    srv = ServerProcess(["--model", str(prefill_model_dir), "--served-model-name", MODEL,
                         "--device", "cpu"]).wait_ready()
    try:
        for salt in ("", "x" * 257, 5):
            r = httpx.post(srv.url + "/v1/completions",
                           json={"model": MODEL, "prompt": "a b", "cache_salt": salt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        # without keys and salts every request shares, as before
        prompt = list(range(2, 100))
        assert _complete(srv.url, "none", prompt)[1] == 0
        assert _complete(srv.url, "none", prompt)[1] == 96
    finally:
        assert srv.terminate() == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from server_utils import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def _burst(url: str, count: int, max_tokens: int, gap_s: float = 0.0) -> list:
    """`count` chat requests at once (or `gap_s` apart): [(status, Retry-After, body)]."""
    import asyncio

    async def one(ac, i):
        await asyncio.sleep(i * gap_s)
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": max_tokens, "ignore_eos": True}
        r = await ac.post(url + "/v1/chat/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), r.json()

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as ac:
            return await asyncio.gather(*[one(ac, i) for i in range(count)])

    return asyncio.run(main())


def test_a_burst_fills_running_slots_and_the_queue_before_any_429(model_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  max_waiting_requests: 4\nengine:\n  max_num_seqs: 32\n")
    srv = ServerProcess(["--config", str(cfg), "--model", str(model_dir), "--served-model-name",
                         MODEL, "--device", "cpu"]).wait_ready()
    try:
        results = _burst(srv.url, 40, max_tokens=48)
        codes = [code for code, _, _ in results]
        assert codes.count(429) <= 4 and codes.count(200) >= 36, codes
        assert set(codes) <= {200, 429}, codes
        for code, retry_after, body in results:
            if code == 200:  # every admitted request completes
                assert body["usage"]["completion_tokens"] == 48
            else:
                assert int(retry_after) >= 1 and body["error"]["code"] == "queue_full"
        # within capacity: all at once, or 50 ms apart, never a 429
        assert [c for c, _, _ in _burst(srv.url, 36, max_tokens=16)] == [200] * 36
        assert [c for c, _, _ in _burst(srv.url, 10, max_tokens=8, gap_s=0.05)] == [200] * 10
    finally:
        assert srv.terminate() == 0


def test_retry_after_follows_the_measured_drain_rate():
    from server.validation import retry_after_s

    assert retry_after_s(5, None, 1) == 1  # nothing measured yet: the configured least
    assert retry_after_s(5, 2.0, 1) == 3  # 5 requests at 2/s
    assert retry_after_s(1, 100.0, 2) == 2  # never below the configured least
    assert retry_after_s(1000, 0.5, 1) == 60  # nor above a minute


def test_sampling_values_float32_cannot_represent_are_greedy_or_refused(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL,
                         "--device", "cpu"]).wait_ready()

    def complete(**extra):
        return httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12,
            "ignore_eos": True, **extra})

    try:
        greedy = complete(temperature=0).json()["choices"][0]["text"]
        for extra in ({"temperature": 1e-300}, {"temperature": 5e-324},
                      {"temperature": 1.0, "top_p": 1e-300, "seed": 3},
                      {"temperature": 1.0, "top_p": 1e-300},
                      {"temperature": 1e-300, "top_p": 1e-300, "min_p": 1e-300}):
            r = complete(**extra)
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["text"] == greedy, extra
        for value in (1e-300, 5e-324, 0.001):
            r = complete(repetition_penalty=value)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "repetition_penalty"
        assert complete(repetition_penalty=0.01).status_code == 200  # the floor itself serves
    finally:
        assert srv.terminate() == 0


# -- HTTP limits and timeouts, over raw sockets ----------------------------------------------

HTTP_LIMITS = ("server:\n  header_timeout_s: 1.0\n  body_timeout_s: 2.0\n"
               "  max_connections: 120\n  keep_alive_timeout_s: 1.0\n")


@pytest.fixture(scope="module")
def limited_server(model_dir, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("limits") / "c.yaml"
    cfg.write_text(HTTP_LIMITS)
    srv = ServerProcess(["--config", str(cfg), "--model", str(model_dir), "--served-model-name",
                         MODEL, "--device", "cpu"]).wait_ready()
    yield srv
    assert srv.terminate() == 0


def _raw(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict | None, bytes]:
    """Send `data` on a fresh connection (the server may stop reading early); return the
    status, the JSON body if any, and everything read until the server closed."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            for i in range(0, len(data), 1 << 16):
                sock.sendall(data[i:i + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else 0
    return status, (json.loads(body) if body.startswith(b"{") else None), received


def _openai_error(body: dict | None, code: str) -> bool:
    return (body is not None and set(body["error"]) == {"message", "type", "param", "code"}
            and body["error"]["code"] == code)


def test_oversized_heads_get_openai_shaped_errors(limited_server):
    port = limited_server.port
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    status, body, _ = _raw(port, big)
    assert status == 431 and _openai_error(body, "headers_too_large"), body
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(100)) + b"\r\n"
    status, body, _ = _raw(port, many)  # 100 KB in small headers
    assert status == 431 and _openai_error(body, "headers_too_large"), body
    status, body, _ = _raw(port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 414 and _openai_error(body, "uri_too_long"), body
    status, body, _ = _raw(port, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and _openai_error(body, "invalid_http"), body
    # just under the limit is served
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Ok: " + b"c" * 60000
    status, body, _ = _raw(port, ok + b"\r\n\r\n")
    assert status == 200, body
    assert httpx.head(limited_server.url + "/health").status_code == 200


def test_early_413_closes_and_mid_body_disconnect_is_499(limited_server):
    import socket

    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    started = time.monotonic()
    status, body, _ = _raw(limited_server.port, head % (64 << 20))  # no body ever sent
    assert status == 413 and time.monotonic() - started < 1.0  # answered and closed at once
    with socket.create_connection(("127.0.0.1", limited_server.port)) as sock:
        sock.sendall(head % 100 + b'{"model": ')
        time.sleep(0.3)
    deadline = time.monotonic() + 5
    while " 499 " not in limited_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "POST /v1/completions 499" in limited_server.log()


def test_slow_clients_are_cut_off_while_health_stays_fast(limited_server):
    import asyncio

    port = limited_server.port
    body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 1000\r\n\r\n")

    async def trickle(first: bytes) -> tuple[float, bytes]:
        """Send `first`, then a byte every 0.2 s until the server closes; (seconds open, what
        it answered)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(first)
        answer = b""
        try:
            while time.monotonic() - started < 15:
                try:
                    answer += await asyncio.wait_for(reader.read(4096), 0.2)
                    if reader.at_eof():
                        break
                except asyncio.TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass
        writer.close()
        return time.monotonic() - started, answer

    async def health_latencies() -> list[float]:
        out = []
        async with httpx.AsyncClient() as ac:
            await asyncio.sleep(0.3)
            for _ in range(20):
                started = time.perf_counter()
                assert (await ac.get(limited_server.url + "/health")).status_code == 200
                out.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)
        return out

    async def main():
        slow = [trickle(b"GET /health HTTP/1.1\r\nHost: x\r\n") for _ in range(50)]
        slow += [trickle(body_head + b'{"model"') for _ in range(50)]
        return await asyncio.gather(asyncio.gather(*slow), health_latencies())

    (results, latencies) = asyncio.run(main())
    header_open = [seconds for seconds, _ in results[:50]]
    body_open = [seconds for seconds, _ in results[50:]]
    assert max(header_open) < 1.0 + 1.5, header_open  # header_timeout_s 1 (+ slack)
    assert max(body_open) < 2.0 + 1.5, body_open  # body_timeout_s 2 (+ slack)
    assert all(b" 408 " in answer.split(b"\r\n")[0] for _, answer in results)
    assert statistics.median(latencies) < 0.05 and sorted(latencies)[-3] < 0.05, latencies


def test_connections_beyond_the_cap_get_503(limited_server):
    import socket

    idle = [socket.create_connection(("127.0.0.1", limited_server.port)) for _ in range(120)]
    try:
        time.sleep(0.2)
        r = httpx.get(limited_server.url + "/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        assert r.headers["connection"] == "close" and "retry-after" in r.headers
        assert httpx.get(limited_server.url + "/health").status_code == 200  # probes pass
    finally:
        for sock in idle:
            sock.close()
    time.sleep(1.5)  # the header timeout closes what is left of them
    assert httpx.get(limited_server.url + "/v1/models").status_code == 200
