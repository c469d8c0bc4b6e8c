"""Metrics of a real server, a real Prometheus running every dashboard query, a real nginx.

Prometheus and nginx come from Debian's packages (.ci/run installs them). Where they are not
installed these tests skip, unless SPECSERVE_REQUIRE_DEPLOY_TOOLS=1 (CI sets it) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from server_utils import ServerProcess, free_port, save_tiny_model, wait_ok

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
HELLO = [{"role": "user", "content": "The quick brown fox"}]


def need(binary: str) -> str:
    path = shutil.which(binary) or next(
        (p for p in (f"/usr/sbin/{binary}", f"/usr/bin/{binary}") if os.path.exists(p)), None)
    if path is None:
        if os.environ.get("SPECSERVE_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail(f"{binary} is required here (Debian package {binary})")
        pytest.skip(f"{binary} is not installed (Debian package {binary})")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def spec_config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(f"""engine:
  model: {model_dir}
  device: cpu
  num_threads: 1
  speculative:
    method: hybrid
    draft_model: {model_dir}
    k_max: 4
    adaptive: false
""")
    return cfg


@pytest.fixture(scope="module")
def spec_server(model_dir, tmp_path_factory):
    cfg = spec_config(tmp_path_factory.mktemp("cfg"), model_dir)
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", MODEL]).wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.log()


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, from the Prometheus text format."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if re.fullmatch(rf"{re.escape(name)}(\{{.*\}})?", k))


def load(url: str, n: int = 6, max_tokens: int = 24, stream: bool = False) -> int:
    async def one(ac, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"fox {i} " * 3}],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        r = await ac.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            return sum(await asyncio.gather(*[one(ac, i) for i in range(n)]))

    return asyncio.run(main())


METRICS = [
    "specserve:prompt_tokens_total", "specserve:generation_tokens_total",
    "specserve:request_success_total", "specserve:spec_decode_num_drafts_total",
    "specserve:spec_decode_num_draft_tokens_total", "specserve:spec_decode_num_accepted_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_per_pos_total", "specserve:num_preemptions_total",
    "specserve:prefix_cache_queries_total", "specserve:prefix_cache_hits_total",
    "specserve:http_requests_total", "specserve:time_to_first_token_seconds_bucket",
    "specserve:inter_token_latency_seconds_bucket", "specserve:e2e_request_latency_seconds_bucket",
    "specserve:request_queue_time_seconds_bucket", "specserve:spec_decode_accepted_length_bucket",
    "specserve:num_requests_running", "specserve:num_requests_waiting",
    "specserve:kv_cache_usage_perc", "specserve:spec_decode_k", "specserve:model_info",
    "specserve:spec_decode_suffix_cache_tokens", "specserve:spec_decode_num_tree_verifications_total",
    "specserve:spec_decode_num_tree_nodes_total",
    "specserve:spec_decode_num_chain_steps_chosen_total",
]


def test_every_metric_exists_with_sensible_values(spec_server):
    before = scrape(spec_server.url)
    completion_tokens = load(spec_server.url)
    time.sleep(1.5)  # the idle refresh publishes the gauges
    after = scrape(spec_server.url)
    for name in METRICS:
        assert any(k == name or k.startswith(name + "{") for k in after), name
    grew = total(after, "specserve:generation_tokens_total") - total(
        before, "specserve:generation_tokens_total")
    assert grew == completion_tokens
    drafted = total(after, "specserve:spec_decode_num_draft_tokens_total")
    accepted = total(after, "specserve:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    for method in ("draft_model", "suffix"):  # hybrid: each method's tokens apart
        key = f'{{method="{method}"}}'
        assert 0 < after["specserve:spec_decode_num_accepted_tokens_total" + key] \
            <= after["specserve:spec_decode_num_draft_tokens_total" + key], method
    assert after["specserve:spec_decode_suffix_cache_tokens"] > 0
    per_pos = [after.get(f'specserve:spec_decode_num_accepted_tokens_per_pos_total'
                         f'{{position="{j}"}}', 0.0) for j in range(4)]
    assert per_pos[0] > 0 and all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert total(after, "specserve:num_requests_running") == 0
    assert total(after, "specserve:num_requests_waiting") == 0
    assert total(after, "specserve:kv_cache_usage_perc") == 0
    assert after['specserve:request_success_total{finish_reason="length"}'] >= 6
    assert after["specserve:time_to_first_token_seconds_count"] >= 6
    assert after["specserve:spec_decode_accepted_length_count"] > 0
    ok = after.get('specserve:http_requests_total{route="/v1/chat/completions",status="200"}')
    assert ok and ok >= 6


def dashboard_queries() -> list[str]:
    dash = json.loads((ROOT / "deploy" / "grafana" / "specserve.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_prometheus_runs_every_dashboard_query(spec_server, tmp_path):
    prometheus = need("prometheus")
    port = free_port()
    target = spec_server.url.split("//")[1]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['{target}']}}]\n")
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        assert wait_ok(f"http://127.0.0.1:{port}/-/ready", 60), "prometheus did not start"
        end = time.monotonic() + 12  # a short load across several scrapes
        while time.monotonic() < end:
            load(spec_server.url, n=4, max_tokens=16)
            httpx.post(spec_server.url + "/v1/chat/completions", json={"model": "nope"})  # a 4xx
        time.sleep(3)
        empty = []
        for expr in dashboard_queries():
            query = expr.replace("$instance", ".*")
            r = httpx.get(api + "/query", params={"query": query}).json()
            assert r["status"] == "success", (query, r)
            if not r["data"]["result"]:
                empty.append(query)
        assert not empty, empty
    finally:
        proc.terminate()
        proc.wait(10)


def test_nginx_streams_unbuffered_and_survives_a_replica_kill(model_dir, tmp_path):
    nginx = need("nginx")
    render = __import__("runpy").run_path(str(ROOT / "deploy" / "nginx" / "render.py"))["render"]
    replicas = [ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL,
                               "--device", "cpu", "--num-threads", "1"]) for _ in range(2)]
    for r in replicas:
        r.wait_ready()
    port = free_port()
    runtime = tmp_path / "nginx"
    runtime.mkdir()
    conf = runtime / "nginx.conf"
    conf.write_text(render([f"127.0.0.1:{r.port}" for r in replicas], f"127.0.0.1:{port}",
                           str(runtime)))
    globals_ = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(runtime), "-g", globals_],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ok(url + "/ready", 20), "nginx did not start"
        # 0. only /v1/, /health and /ready are public: /metrics is scraped on the replicas
        assert httpx.get(url + "/health").status_code == 200
        for path in ("/metrics", "/docs", "/openapi.json", "/"):
            r = httpx.get(url + path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
        assert httpx.get(f"http://127.0.0.1:{replicas[0].port}/metrics").status_code == 200
        # 1. streaming passes through unbuffered: the first chunk long before the last
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 800, "stream": True,
                "ignore_eos": True}
        t0 = time.monotonic()
        first = last = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first = first or time.monotonic() - t0
                last = time.monotonic() - t0
        assert first is not None and first < 0.5 * last, (first, last)

        # 2. kill one replica mid-load: requests keep succeeding through the other
        results = []

        async def worker(ac, stop_at):
            while time.monotonic() < stop_at:
                started = time.monotonic()
                try:
                    r = await ac.post(url + "/v1/chat/completions", json={
                        "model": MODEL, "messages": HELLO, "max_tokens": 30, "ignore_eos": True})
                    code = r.status_code
                except httpx.HTTPError:
                    code = -1
                results.append((started, time.monotonic(), code))

        async def main():
            async with httpx.AsyncClient(timeout=60) as ac:
                stop_at = time.monotonic() + 8
                tasks = [asyncio.create_task(worker(ac, stop_at)) for _ in range(4)]
                await asyncio.sleep(2.5)
                kill_time = time.monotonic()
                replicas[0].proc.kill()
                await asyncio.gather(*tasks)
                return kill_time

        kill_time = asyncio.run(main())
        done_before = [code for _, end, code in results if end < kill_time]
        started_after = [code for start, _, code in results if start >= kill_time + 0.2]
        failed = [(start, end) for start, end, code in results if code != 200]
        assert done_before and all(code == 200 for code in done_before)
        assert len(started_after) >= 5 and all(code == 200 for code in started_after)
        # only requests in flight on the killed replica may fail: at most the 4 workers' ones,
        # all of them started before nginx could notice the kill
        assert len(failed) <= 4
        assert all(start < kill_time + 0.2 and end >= kill_time for start, end in failed)
    finally:
        proc.terminate()
        proc.wait(10)
        for r in replicas:
            r.terminate()


class _Upstream:
    """A loopback HTTP server standing in for a replica, to drive nginx's failure accounting:
    it answers `status` after `delay` seconds; after close() it refuses new connections and
    drops the open (keep-alive) ones unanswered, as a killed process does."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        upstream = self
        self.status, self.delay, self.answers, self.dead = 200, 0.0, [], False

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if upstream.dead:
                    self.close_connection = True
                    return
                status = upstream.status
                time.sleep(upstream.delay)
                body = json.dumps({"status": status}).encode()
                # recorded before the answer leaves: a client that has its response can read it
                upstream.answers.append(status)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.dead = True
        self.server.shutdown()
        self.server.server_close()


def test_nginx_serves_through_a_replica_on_probation_when_the_other_dies(tmp_path):
    """A replica that failed once (a 503 while it drained) is on probation in nginx: one probe
    request per fail_timeout until one succeeds. If the other replica dies while the probe (a
    generation: seconds) is in flight, requests must still reach the one on probation (the
    config's backup entries), never a 502 "no live upstreams"."""
    nginx = need("nginx")
    render = __import__("runpy").run_path(str(ROOT / "deploy" / "nginx" / "render.py"))["render"]
    a, b = _Upstream(), _Upstream()
    port = free_port()
    runtime = tmp_path / "nginx"
    runtime.mkdir()
    conf = runtime / "nginx.conf"
    conf.write_text(render([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], f"127.0.0.1:{port}",
                           str(runtime), fail_timeout_s=1))
    globals_ = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(runtime), "-g", globals_],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.post(url, json={}, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.1)
        # a drains: its 503 is retried on b, and nginx puts a on probation
        a.status = 503
        for _ in range(4):
            assert httpx.post(url, json={}, timeout=10).status_code == 200
        assert 503 in a.answers
        a.status, a.delay = 200, 1.5
        time.sleep(1.2)  # past fail_timeout: a is probed again with the next request
        b.close()        # the other replica dies

        async def main():
            async with httpx.AsyncClient(timeout=30) as ac:
                probe = asyncio.create_task(ac.post(url, json={}))
                await asyncio.sleep(0.3)  # the probe is in flight on a: a counts as out
                rest = [ac.post(url, json={}) for _ in range(3)]
                return [r.status_code for r in await asyncio.gather(probe, *rest)]

        assert asyncio.run(main()) == [200] * 4
        assert a.answers[-4:] == [200] * 4
    finally:
        proc.terminate()
        proc.wait(10)
        a.close()
