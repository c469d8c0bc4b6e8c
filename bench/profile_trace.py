"""Where an engine step's time goes, from a torch profiler trace (chrome JSON).

`profile_steps` runs engine steps under torch.profiler with every step and its phases
(schedule, execute, verify, update, propose) annotated; `summarise` reads the trace back:

- per step (from one step's start to the next one's): wall time;
- device busy: the union of the intervals of the kernels, copies and memsets in the step;
- device idle: wall minus busy (launch gaps and waits for the host);
- host blocked: the host's time in synchronizing CUDA calls (the step's device read);
- host work: wall minus host blocked (Python, scheduling, kernel and graph launches);
- each phase's host time, and the kernels by device time per step.

Means over the profiled steps (`profile_steps` runs its warm-up steps before profiling).
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

STEP = "specserve.step"
PHASE_PREFIX = "specserve."
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# the calls in which the host waits for the device
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaStreamWaitEvent", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"}
PHASES = {"schedule": ("scheduler", "schedule"), "execute": ("runner", "execute"),
          "verify": ("verifier", "verify"), "update": (None, "_update"),
          "propose": ("speculator", "propose")}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _clip(a: float, b: float, lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(a, lo), min(b, hi)
    return (a, b) if b > a else None


def summarise(trace: dict) -> dict:
    """Per-step means of a trace whose steps are annotated `specserve.step` (at least two:
    a step ends where the next one starts, so the last one only closes the one before)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted(e["ts"] for e in events
                   if e.get("cat") == "user_annotation" and e["name"] == STEP)
    if len(steps) < 2:
        raise ValueError(f"the trace has {len(steps)} `{STEP}` ranges: needs at least 2")
    windows = list(zip(steps, steps[1:]))
    per_step: list[dict] = []
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # calls, microseconds
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    sync = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
            and e["name"] in SYNC_CALLS]
    phases = [e for e in events if e.get("cat") == "user_annotation"
              and e["name"].startswith(PHASE_PREFIX) and e["name"] != STEP]
    for lo, hi in windows:
        busy, ops = [], 0
        for e in device:
            cut = _clip(e["ts"], e["ts"] + e["dur"], lo, hi)
            if cut:
                busy.append(cut)
            if lo <= e["ts"] < hi:  # started in this step: its calls and time count here
                ops += 1
                k = kernels[e["name"] if e["cat"] == "kernel" else f"[{e['cat']}]"]
                k[0] += 1
                k[1] += e["dur"]
        blocked = sum(b - a for a, b in filter(None, (
            _clip(e["ts"], e["ts"] + e["dur"], lo, hi) for e in sync)))
        row = {"wall": hi - lo, "device_busy": _union(busy), "host_blocked": blocked,
               "device_ops": ops}
        for e in phases:
            if lo <= e["ts"] < hi:
                name = e["name"][len(PHASE_PREFIX):]
                row[f"phase:{name}"] = row.get(f"phase:{name}", 0.0) + e["dur"]
        per_step.append(row)
    n = len(per_step)
    keys = sorted({k for row in per_step for k in row})
    mean = {k: sum(row.get(k, 0.0) for row in per_step) / n for k in keys}
    mean["device_idle"] = mean["wall"] - mean["device_busy"]
    mean["host_work"] = mean["wall"] - mean["host_blocked"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"steps": n, "mean_us": mean,
            "median_wall_us": statistics.median(row["wall"] for row in per_step),
            "kernels": [(name, calls / n, us / n) for name, (calls, us) in top]}


def table(summary: dict, top: int = 12) -> str:
    """The summary as markdown: the step's time split, the phases, the kernels."""
    m, n = summary["mean_us"], summary["steps"]
    wall = m["wall"]

    def row(label: str, us: float) -> str:
        return f"| {label} | {us / 1e3:.3f} | {100 * us / wall:.0f}% |"

    lines = [f"Per step, mean of {n} steps (median wall {summary['median_wall_us'] / 1e3:.3f} ms):",
             "", "| part of the step | ms | share of wall |", "|---|---|---|",
             row("wall (step start to the next step's start)", wall),
             row("device busy (kernels, copies, memsets: their union)", m["device_busy"]),
             row("device idle (launch gaps, waits for the host)", m["device_idle"]),
             row("host blocked in CUDA synchronization (the step's read)", m["host_blocked"]),
             row("host work (wall minus blocked)", m["host_work"])]
    lines += [row(f"phase {k[len('phase:'):]} (host time, blocked time included)", v)
              for k, v in m.items() if k.startswith("phase:")]
    lines += [f"| device operations per step | {m['device_ops']:.0f} | |"]
    if not m["device_ops"]:
        lines += ["", "No device activity in the trace (a CPU run, or the profiler did not "
                  "trace the device): device busy and idle say nothing here."]
    if summary["kernels"]:
        busy = m["device_busy"] or 1.0
        lines += ["", "| kernel (top by device time) | calls per step | us per step | "
                  "share of busy |", "|---|---|---|---|"]
        lines += [f"| `{name[:90]}` | {calls:.1f} | {us:.1f} | {100 * us / busy:.0f}% |"
                  for name, calls, us in summary["kernels"][:top]]
    return "\n".join(lines)


def _annotated(obj, name: str, label: str, record_function) -> None:
    method = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with record_function(PHASE_PREFIX + label):
            return method(*args, **kwargs)

    setattr(obj, name, wrapped)  # an instance attribute: shadows the class's method


def profile_steps(engine, prompt: list[int], steps: int, warmup: int,
                  trace_path: str | None = None) -> dict:
    """One greedy request of `prompt`: its prefill and `warmup` decode steps unprofiled, then
    `steps` + 1 decode steps under torch.profiler (CUDA activity where the engine runs on
    CUDA). Returns `summarise`'s result; writes the trace (gzipped JSON) to `trace_path`."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    for _ in range(warmup + 1):
        engine.step()
    for label, (owner, name) in PHASES.items():
        _annotated(getattr(engine, owner) if owner else engine, name, label, record_function)
    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps + 1):
                with record_function(STEP):
                    engine.step()
    finally:
        for owner, name in PHASES.values():
            vars(getattr(engine, owner) if owner else engine).pop(name, None)
        engine.abort(rid)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
    if trace_path:
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    return summarise(trace)
