"""The client side of scripts/image_check.sh: what a user of the compose deployment sees.

  client.py basic URL                one chat completion and one streamed completion (openai)
  client.py load URL OUT STOP_FILE   requests (streamed and not) until STOP_FILE exists, each
                                     recorded in OUT (JSON): how it ended and how long it took
  client.py verdict OUT --expect-failures none|clean
                                     none: every request succeeded; clean: failures allowed, each
                                     a clean error before the client's timeout, and later requests
                                     succeed again
  client.py prom PROM_URL DASHBOARD  Prometheus: both replicas up, the acceptance and tokens/s
                                     series present, every dashboard query evaluates
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai

MODEL = "qwen2.5-coder-1.5b-instruct"
TIMEOUT_S = 120.0  # the client's timeout: a request past it is a hang, never a clean error
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a hash map is.",
           "Write a shell one-liner that counts the lines of all .py files.",
           "What does `git rebase` do?"]


def _client(url: str) -> openai.OpenAI:
    # no retries: a failure must show here, not be hidden by the SDK's own retry
    return openai.OpenAI(base_url=url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def basic(url: str) -> int:
    """A chat completion and a streamed completion (least connections: one per replica)."""
    client = _client(url)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32,
        temperature=0)
    text = chat.choices[0].message.content or ""
    print(f"  chat completion: {chat.usage.completion_tokens} tokens, "
          f"finish_reason={chat.choices[0].finish_reason}: {text[:60]!r}")
    stream = client.completions.create(model=MODEL, prompt="def quicksort(xs):", max_tokens=32,
                                       temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    print(f"  streamed completion: {len(pieces)} chunks, finish_reason={finish}: "
          f"{''.join(pieces)[:60]!r}")
    ok = bool(text) and len(pieces) > 1 and finish in ("stop", "length")
    return 0 if ok else 1


def _one(client: openai.OpenAI, i: int) -> dict:
    streamed = i % 2 == 0
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    start = time.monotonic()
    record = {"i": i, "streamed": streamed, "start": time.time()}
    try:
        if streamed:
            chunks, finish = 0, None
            for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                        max_tokens=32, temperature=0,
                                                        stream=True):
                if chunk.choices:
                    chunks += 1
                    finish = chunk.choices[0].finish_reason or finish
            if finish is None:  # the stream ended without its last event
                raise RuntimeError(f"stream cut after {chunks} chunks (no finish_reason)")
        else:
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                 temperature=0)
            finish = out.choices[0].finish_reason
        record.update(ok=True, finish=finish)
    except Exception as exc:  # noqa: BLE001 - every way a request can end is recorded
        record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        time.sleep(0.5)  # as a client would before its next try
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


def load(url: str, out: str, stop_file: str, concurrency: int) -> int:
    """Requests from `concurrency` threads, a new one as soon as one ends, until stop_file."""
    client, records, lock = _client(url), [], threading.Lock()
    counter = iter(range(10**9))

    def worker():
        while not Path(stop_file).exists():
            with lock:
                i = next(counter)
            record = _one(client, i)
            with lock:
                records.append(record)
                Path(out).write_text(json.dumps(records))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(sorted(records, key=lambda r: r["start"])))
    return 0


def verdict(out: str, expect: str, kill_time: float | None = None) -> int:
    records = json.loads(Path(out).read_text())
    failed = [r for r in records if not r["ok"]]
    slowest = max((r["seconds"] for r in records), default=0.0)
    print(f"  {len(records)} requests, {len(failed)} failed, slowest {slowest:.1f}s "
          f"(client timeout {TIMEOUT_S:.0f}s)")
    for r in failed[:20]:
        print(f"    failed after {r['seconds']}s ({'stream' if r['streamed'] else 'plain'}): "
              f"{r['error']}")
    if not records:
        return 1
    if expect == "none":
        return 0 if not failed else 1
    hung = [r for r in failed if r["seconds"] >= TIMEOUT_S * 0.95 or "Timeout" in r["error"]]
    # only what was in flight when the replica was killed may fail: nginx sends the rest on
    new_failed = [r for r in failed if kill_time is not None and r["start"] > kill_time]
    if new_failed:
        print(f"  {len(new_failed)} request(s) started after the kill failed")
    last_failure = max((r["start"] for r in failed), default=0.0)
    later_ok = [r for r in records if r["ok"] and r["start"] > last_failure]
    if hung:
        print(f"  {len(hung)} failure(s) ran into the client's timeout: a hang")
    if not later_ok:
        print("  no request succeeded after the last failure")
    return 0 if not hung and later_ok and not new_failed else 1


def _prom(url: str, path: str, **params) -> dict:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as resp:
        return json.load(resp)


def prom(url: str, dashboard: str) -> int:
    bad = []
    targets = _prom(url, "/api/v1/targets")["data"]["activeTargets"]
    health = {t["labels"]["instance"]: t["health"] for t in targets}
    print(f"  targets: {health}")
    if len(health) != 2 or set(health.values()) != {"up"}:
        bad.append("both replicas up")
    for series in ("specserve:spec_decode_num_accepted_tokens_total",
                   "specserve:spec_decode_num_draft_tokens_total",
                   "specserve:generation_tokens_total"):
        result = _prom(url, "/api/v1/query", query=series)["data"]["result"]
        instances = sorted({r["metric"]["instance"] for r in result})
        print(f"  {series}: {len(result)} series from {instances}")
        if len(instances) != 2:
            bad.append(series)
    panels = json.loads(Path(dashboard).read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    for expr in exprs:
        answer = _prom(url, "/api/v1/query", query=expr.replace("$instance", ".*"))
        if answer.get("status") != "success":
            bad.append(f"dashboard query {expr}")
    print(f"  {len(exprs)} dashboard queries evaluated by Prometheus, "
          f"{len(exprs) - sum(b.startswith('dashboard') for b in bad)} ok")
    for b in bad:
        print(f"    not ok: {b}")
    return 0 if not bad else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("basic").add_argument("url")
    p = sub.add_parser("load")
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("stop_file")
    p.add_argument("--concurrency", type=int, default=3)
    p = sub.add_parser("verdict")
    p.add_argument("out")
    p.add_argument("--expect-failures", choices=["none", "clean"], required=True)
    p.add_argument("--kill-time", type=float, help="clean: when a replica was killed (epoch s)")
    p = sub.add_parser("prom")
    p.add_argument("url")
    p.add_argument("dashboard")
    a = ap.parse_args()
    if a.cmd == "basic":
        return basic(a.url)
    if a.cmd == "load":
        return load(a.url, a.out, a.stop_file, a.concurrency)
    if a.cmd == "verdict":
        return verdict(a.out, a.expect_failures, a.kill_time)
    return prom(a.url, a.dashboard)


if __name__ == "__main__":
    sys.exit(main())
