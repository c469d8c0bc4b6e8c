"""An engine that fails is never a hang: a failed step fails its requests with a 500 and the
server goes on; an engine process that dies fails every request in flight at once and the
server exits non-zero; a model that cannot load is one line and an exit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess, save_tiny_model

MODEL = "tiny"
FAULT = 7  # the test hook (SPECSERVE_FAULT_ON_TOKEN): a step over this token id raises
GOOD = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 8, "temperature": 0,
        "logit_bias": {str(FAULT): -100}}  # never generates the fault token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def start(model_dir, *extra, env=None) -> ServerProcess:
    return ServerProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--device",
                          "cpu", "--num-threads", "1", *extra], env=env).wait_ready()


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_failed_step_is_a_500_for_its_requests_and_the_server_goes_on(model_dir,
                                                                       engine_process):
    srv = start(model_dir, *(["--engine-process"] if engine_process else []),
                env={"SPECSERVE_FAULT_ON_TOKEN": str(FAULT)})
    try:
        url = srv.url + "/v1/completions"
        assert httpx.post(url, json=GOOD, timeout=30).status_code == 200
        bad = {**GOOD, "prompt": [3, FAULT, 5]}
        r = httpx.post(url, json=bad, timeout=30)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        with httpx.stream("POST", url, json={**bad, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        assert events[-1] == "[DONE]"
        r = httpx.post(url, json=GOOD, timeout=30)  # the engine goes on
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(srv.url + "/ready").status_code == 200
    finally:
        assert srv.terminate() == 0, srv.log()


def _engine_pid(srv: ServerProcess) -> int:
    for line in srv.log().splitlines():
        if "engine process started (pid" in line:
            return int(line.split("(pid ")[1].split(")")[0])
    raise AssertionError(f"no engine process in the log:\n{srv.log()}")


def test_a_killed_engine_process_fails_requests_at_once_and_the_server_exits(model_dir):
    srv = start(model_dir, "--engine-process")
    try:
        body = {**GOOD, "max_tokens": 1000, "stream": True, "ignore_eos": True}
        events, first, done = [], threading.Event(), threading.Event()

        def stream():
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append((time.monotonic(), line[6:]))
                        first.set()
            done.set()

        threading.Thread(target=stream, daemon=True).start()
        assert first.wait(30)
        killed = time.monotonic()
        os.kill(_engine_pid(srv), signal.SIGKILL)
        assert done.wait(5)
        errors = [(t, e) for t, e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and errors[0][0] - killed < 1.0
        assert json.loads(errors[0][1])["error"]["type"] == "server_error"
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503
        assert httpx.post(srv.url + "/v1/completions", json=GOOD).status_code == 503
        assert srv.proc.wait(30) == 1
        assert "engine process exited" in srv.log()
    finally:
        srv.terminate()


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_model_that_cannot_load_is_one_line_and_an_exit(engine_process):
    srv = ServerProcess(["--model", "no-such-model", "--device", "cpu",
                         *(["--engine-process"] if engine_process else [])],
                        env={"HF_HUB_OFFLINE": "1"})
    try:
        assert srv.proc.wait(120) == 1
        log = srv.log()
        assert "'no-such-model' is not a recipe, not a local folder" in log
        assert "specserve models list" in log and "(HF_HUB_OFFLINE is set)" in log
        assert "Traceback" not in log
    finally:
        srv.terminate()


def test_a_step_that_breaks_the_engine_state_fails_every_request_and_kills_the_client():
    from conftest import build_tiny_model
    from engine import EngineConfig, LLMEngine, SamplingParams
    from server.engine_client import EngineClient, EngineDeadError, EngineStepError

    engine = LLMEngine(EngineConfig(num_blocks=64, max_num_seqs=1),
                       model=build_tiny_model("qwen2"))
    execute = engine.runner.execute

    def breaking(items, *args, **kw):
        if any(FAULT in item.token_ids for item in items):
            engine.block_manager.blocks[0].ref_count += 1  # the pool no longer adds up
            raise RuntimeError("broken")
        return execute(items, *args, **kw)

    engine.runner.execute = breaking
    client = EngineClient.in_thread(engine)
    client.start()

    async def run():
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        bad = client.submit("bad", [1, FAULT], params)
        waiting = client.submit("waiting", [1, 2], params)  # max_num_seqs 1: not in the step
        results = []
        for stream in (bad, waiting):
            try:
                async for _ in stream:
                    pass
                results.append("finished")
            except (EngineStepError, EngineDeadError) as exc:
                results.append(exc)
        return results

    import asyncio

    results = asyncio.run(asyncio.wait_for(run(), 30))
    assert isinstance(results[0], EngineStepError) and "broken" in str(results[0])
    assert isinstance(results[1], EngineDeadError), results  # not in the step, yet lost
    assert "the engine failed: broken" in str(results[1])
    assert not client.alive and "broken" in client.failure
    client.shutdown()


def test_the_engine_process_leaves_signals_to_the_server(model_dir):
    """Ctrl-C or a signal to the whole process group reaches the engine process too: it goes
    on serving, and the server drains, stops it, and exits 0."""
    srv = start(model_dir, "--engine-process")
    try:
        pid = _engine_pid(srv)
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(srv.url + "/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 200
        assert httpx.get(srv.url + "/ready").status_code == 200
    finally:
        assert srv.terminate() == 0, srv.log()
