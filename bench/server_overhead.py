"""HTTP overhead: the same requests through the server (streamed), with the engine in a thread
of the server or in an engine process of its own, vs the engine's offline `generate`, at each
concurrency; same model and engine settings.

    python bench/server_overhead.py [--model smollm2-135m-instruct] [--concurrency 1,16,32]

Ends with `RESULT http_overhead_thread=<http time / offline time, worst concurrency>
http_overhead_process=... process_vs_thread=<thread time / process time, worst concurrency>`;
writes bench/results/server_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from results_file import write_results  # noqa: E402
from server_utils import ServerProcess  # noqa: E402


def prompts(n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in
            (ROOT / "bench" / "prompts" / "chat.jsonl").read_text().splitlines() if line.strip()]
    return [rows[i % len(rows)]["messages"] for i in range(n)]


async def http_run(url: str, model: str, messages: list, max_tokens: int,
                   concurrency: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)

    async def one(ac, msgs):
        body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with gate, ac.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(timeout=600) as ac:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[one(ac, m) for m in messages])
        return time.perf_counter() - t0, sum(counts)


def offline_run(engine: LLMEngine, ids: list, params: SamplingParams,
                concurrency: int) -> tuple[float, int]:
    """`generate` over the requests in waves of `concurrency` (what the HTTP clients keep in
    flight; the same total work)."""
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(ids), concurrency):
        tokens += sum(len(o.output_token_ids) for o in engine.generate(ids[i:i + concurrency],
                                                                     params))
    return time.perf_counter() - t0, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,16,32")
    parser.add_argument("--least-requests", type=int, default=8,
                        help="requests per concurrency at least (c=1 runs them one by one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "server_overhead.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    common = {"max_num_seqs": max(levels), "max_num_batched_tokens": 512,
              "num_threads": args.threads}
    seconds: dict[tuple[str, int], tuple[float, int]] = {}
    for mode in ("thread", "process"):
        srv = ServerProcess(["--model", args.model, "--served-model-name", "bench", "--device",
                             "cpu", "--dtype", "float32", "--num-threads", str(args.threads),
                             "--speculative", "none", "--log-level", "warning",
                             "--engine-process" if mode == "process" else "--no-engine-process"]
                            ).wait_ready(600)
        try:
            asyncio.run(http_run(srv.url, "bench", prompts(2), 4, 2))  # warm-up
            for c in levels:
                seconds[mode, c] = asyncio.run(http_run(
                    srv.url, "bench", prompts(max(c, args.least_requests)), args.max_tokens, c))
        finally:
            srv.terminate()

    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", **common))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def chat_ids(n: int) -> list[list[int]]:
        return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for m in prompts(n)]

    offline_run(engine, chat_ids(2), SamplingParams(temperature=0, max_tokens=4), 2)  # warm-up
    for c in levels:
        seconds["offline", c] = offline_run(engine, chat_ids(max(c, args.least_requests)),
                                            params, c)

    rows = ["| concurrency | requests | offline tok/s | HTTP, engine thread tok/s | "
            "HTTP, engine process tok/s | thread / offline time | process / offline time |",
            "|---|---|---|---|---|---|---|"]
    for c in levels:
        (off_s, off_t), (th_s, th_t), (pr_s, pr_t) = (seconds[m, c] for m in
                                                       ("offline", "thread", "process"))
        rows.append(f"| {c} | {max(c, args.least_requests)} | {off_t / off_s:.1f} | "
                    f"{th_t / th_s:.1f} | {pr_t / pr_s:.1f} | {th_s / off_s:.3f} | "
                    f"{pr_s / off_s:.3f} |")
    table = "\n".join(rows)
    thread = max(seconds["thread", c][0] / seconds["offline", c][0] for c in levels)
    process = max(seconds["process", c][0] / seconds["offline", c][0] for c in levels)
    versus = min(seconds["thread", c][0] / seconds["process", c][0] for c in levels)
    result = (f"RESULT http_overhead_thread={thread:.3f} http_overhead_process={process:.3f} "
              f"process_vs_thread={versus:.3f}")
    print(table)
    print(result)
    write_results(args.out, "Server overhead", args.threads,
                  [f"model {args.model}, fp32, greedy, {args.max_tokens} new tokens per request, "
                   f"streamed; at each concurrency c, max(c, {args.least_requests}) requests with "
                   f"c in flight; no speculation; the offline engine runs them in waves of c"],
                  table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
