"""HTTP overhead: the same 16 requests through the server (streamed) vs the engine's offline
`generate`, same model and engine settings.

    python bench/server_overhead.py [--model smollm2-135m-instruct] [--max-tokens 64]

Ends with `RESULT http_overhead=<http time / offline time>`; writes
bench/results/server_overhead.md.
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


async def http_run(url: str, model: str, messages: list, max_tokens: int) -> tuple[float, int]:
    async def one(ac, msgs):
        body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with ac.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(timeout=600) as ac:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*[one(ac, m) for m in messages])
        return time.perf_counter() - t0, sum(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "server_overhead.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    messages = prompts(args.requests)
    common = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "num_threads": args.threads}

    srv = ServerProcess(["--model", args.model, "--served-model-name", "bench", "--device", "cpu",
                         "--dtype", "float32", "--num-threads", str(args.threads),
                         "--speculative", "none", "--log-level", "warning"]).wait_ready(600)
    try:
        asyncio.run(http_run(srv.url, "bench", messages[:2], 4))  # warm-up
        http_s, http_tokens = asyncio.run(http_run(srv.url, "bench", messages, args.max_tokens))
    finally:
        srv.terminate()

    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", **common))
    tok = engine.tokenizer
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for m in messages]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate(ids[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(o.output_token_ids) for o in outs)

    ratio = http_s / offline_s
    table = ("| path | requests | tokens | seconds | tokens/s |\n|---|---|---|---|---|\n"
             f"| HTTP, streamed | {args.requests} | {http_tokens} | {http_s:.2f} | "
             f"{http_tokens / http_s:.1f} |\n"
             f"| offline generate | {args.requests} | {offline_tokens} | {offline_s:.2f} | "
             f"{offline_tokens / offline_s:.1f} |")
    result = f"RESULT http_overhead={ratio:.3f}"
    print(table)
    print(result)
    write_results(args.out, "Server overhead", args.threads,
                  [f"model {args.model}, fp32, greedy, {args.max_tokens} new tokens per request, "
                   f"all requests at once, no speculation"], table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
