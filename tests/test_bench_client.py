"""`specserve bench serve` against a real server subprocess on a tiny model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from server_utils import ServerProcess, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    cfg = tmp_path_factory.mktemp("cfg") / "c.yaml"
    cfg.write_text(f"engine:\n  model: {model_dir}\n  device: cpu\n  num_threads: 1\n"
                   f"  speculative:\n    method: draft_model\n    draft_model: {model_dir}\n"
                   f"    k_max: 3\n    adaptive: false\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", "tiny"]).wait_ready()
    yield srv
    srv.terminate()


def bench(base_url, out, *extra):
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", base_url,
           "--concurrency", "1,2", "--num-prompts", "4", "--max-tokens", "12",
           "--dataset", "random:20,12", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), proc.stdout


def test_sweep_numbers_are_consistent_and_plots_written(server, tmp_path):
    data, stdout = bench(server.url + "/v1", tmp_path / "run")
    assert "| concurrency 1 |" in stdout
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["num_requests"] == 4 and lv["errors"] == 0
        assert lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0
        assert lv["output_tokens"] == 4 * 12  # from usage: every request ran to max_tokens
        for metric in ("ttft", "itl", "e2e"):
            assert 0 < lv[metric]["median"] <= lv[metric]["p95"] <= lv[metric]["p99"]
        spec = lv["spec"]  # specserve's /metrics were read around the level
        assert spec is not None and spec["draft_tokens"] > 0
        assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    for name in ("tokens_per_s.png", "itl.png"):
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (tmp_path / "run" / name).stat().st_size > 5000, name
    md = (tmp_path / "run" / "results.md").read_text()
    assert "| concurrency 2 |" in md and "![tokens_per_s](tokens_per_s.png)" in md
    # overlaying an earlier run
    data2, _ = bench(server.url + "/v1", tmp_path / "run2", "--compare", str(tmp_path / "run"))
    assert (tmp_path / "run2" / "tokens_per_s.png").stat().st_size > 1000


def test_http_errors_are_counted_not_raised(server, tmp_path):
    data, _ = bench(server.url + "/v1", tmp_path / "bad", "--model", "no-such-model")
    assert all(lv["errors"] == lv["num_requests"] == 4 for lv in data["levels"])
    assert all(lv["output_tokens_per_s"] == 0 for lv in data["levels"])


def test_dropped_connections_are_counted(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    stop = threading.Event()

    def drop_everything():  # read the request, then hang up without an answer
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            try:
                conn.recv(65536)
            finally:
                conn.close()

    thread = threading.Thread(target=drop_everything, daemon=True)
    thread.start()
    try:
        data, _ = bench(f"http://127.0.0.1:{port}/v1", tmp_path / "drop", "--model", "x")
    finally:
        stop.set()
        thread.join()
        sock.close()
    assert all(lv["errors"] == 4 for lv in data["levels"])
