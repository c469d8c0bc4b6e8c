"""`make gpu-check`'s benchmark works before a GPU is lent: bench/gpu_bench.py --smoke runs every
case on tiny shapes on the CPU, and the profile summary splits a step's time correctly."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_profile_trace():
    """bench/profile_trace.py by path: bench/ on sys.path would shadow packages (bench/agents.py
    is not the `agents` SDK)."""
    spec = importlib.util.spec_from_file_location("profile_trace", ROOT / "bench/profile_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


profile_trace = _load_profile_trace()
summarise, table = profile_trace.summarise, profile_trace.table


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summary_splits_a_step_into_device_and_host_time():
    events = [
        # three steps starting at 0, 1000 and 2000 us: the last only closes the second
        _x("user_annotation", "specserve.step", 0, 900),
        _x("user_annotation", "specserve.step", 1000, 950),
        _x("user_annotation", "specserve.step", 2000, 500),
        _x("user_annotation", "specserve.execute", 100, 200),
        _x("user_annotation", "specserve.verify", 300, 500),
        _x("user_annotation", "specserve.execute", 1100, 300),
        # step 1: two overlapping kernels (300 us of union) and a copy; step 2: one kernel
        # that runs past the next step's start (counted up to it)
        _x("kernel", "gemm", 200, 200),
        _x("kernel", "attn", 300, 200),
        _x("gpu_memcpy", "Memcpy DtoH", 700, 50),
        _x("kernel", "gemm", 1800, 400),
        # the host waits in the step's read; a launch is host work
        _x("cuda_runtime", "cudaStreamSynchronize", 500, 250),
        _x("cuda_runtime", "cudaGraphLaunch", 150, 20),
        _x("cuda_runtime", "cudaStreamSynchronize", 1900, 150),
        _x("cpu_op", "aten::mm", 100, 10),
        {"ph": "M", "name": "process_name", "ts": 0, "pid": 1},
    ]
    s = summarise({"traceEvents": events})
    m = s["mean_us"]
    assert s["steps"] == 2
    assert m["wall"] == pytest.approx(1000)
    assert m["device_busy"] == pytest.approx((350 + 200) / 2)
    assert m["device_idle"] == pytest.approx(1000 - 275)
    assert m["host_blocked"] == pytest.approx((250 + 100) / 2)
    assert m["host_work"] == pytest.approx(1000 - 175)
    assert m["phase:execute"] == pytest.approx(250)
    assert m["phase:verify"] == pytest.approx(250)
    assert m["device_ops"] == pytest.approx(2)
    names = [(name, calls, us) for name, calls, us in s["kernels"]]
    assert names[0] == ("gemm", 1.0, 300.0)
    assert ("[gpu_memcpy]", 0.5, 25.0) in names
    text = table(s)
    assert "| device busy (kernels, copies, memsets: their union) | 0.275 | 28% |" in text
    assert "`gemm`" in text


def test_summary_refuses_a_trace_without_two_steps():
    with pytest.raises(ValueError, match="specserve.step"):
        summarise({"traceEvents": [_x("user_annotation", "specserve.step", 0, 5)]})


def test_gpu_bench_smoke_runs_every_case_and_profiles_a_step(tmp_path):
    out, trace = tmp_path / "gpu_bench.md", tmp_path / "trace.json.gz"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_bench.py", "--smoke", "--out", str(out),
         "--trace", str(trace)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    result = re.search(r"`RESULT (.*)`", text).group(1)
    keys = dict(kv.split("=") for kv in result.split())
    for key in ("b1_roofline_fraction", "b1_vs_hf_compiled", "b4_vs_hf_cb",
                "spec_ideal_fraction", "spec_off_ratio", "spec_b1_vs_plain_modelled"):
        assert math.isfinite(float(keys[key])) and float(keys[key]) >= 0, key
    assert "where a decode step's time goes" in text
    assert "phase execute" in text and "phase verify" in text
    assert "MODELLED packaged pair" in text
    with gzip.open(trace, "rt") as f:
        assert summarise(json.load(f))["steps"] == 8
