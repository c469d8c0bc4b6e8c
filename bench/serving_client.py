"""`specserve bench serve`: a serving benchmark against any OpenAI-compatible server.

A client of the server, not part of it: it speaks HTTP only and must not import `server` or
`engine`. The package does not ship it; `specserve bench serve` loads it from the checkout (see
`server.cli`), and `python bench/serving_client.py` runs it directly.

Streams chat completions with the official `openai` async client at each concurrency level (or
at a Poisson request rate) and measures per request the time to first token, the inter-token
latencies (from chunk arrival times), the end-to-end latency, output tokens (from usage) and
errors (counted, never raised). Against specserve it also reads /metrics before and after each
level for the acceptance rate, mean accepted length and mean k. Writes results.json,
results.md and PNG plots; `--compare DIR ...` overlays earlier runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORDS = ("the of and to in is that for it as with was on be at by this had not are but from "
         "or have an they which one you were all we her she there would their will when who "
         "him been has more if no out so said what up its about than into them can only other "
         "new some could time these two may then do first any my now such like our over man "
         "me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since "
         "against go came right used take three").split()


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelResult:
    label: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    errors: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    output_tokens: int
    ttft: dict
    itl: dict
    e2e: dict
    spec: dict | None = None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q):
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p95": pct(0.95), "p99": pct(0.99)}


def load_dataset(spec: str, num_prompts: int, seed: int = 0) -> list[dict]:
    """`random:IN,OUT` or a .jsonl of {"messages": [...], "max_tokens"?: n} rows."""
    rng = random.Random(seed)
    if spec.startswith("random:"):
        n_in, n_out = (int(x) for x in spec[len("random:"):].split(","))
        return [{"messages": [{"role": "user", "content": " ".join(
            rng.choice(WORDS) for _ in range(n_in))}], "max_tokens": n_out}
            for _ in range(num_prompts)]
    rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{spec}: no prompts")
    return [dict(rows[i % len(rows)]) for i in range(num_prompts)]


async def one_request(client, model: str, row: dict, max_tokens: int,
                      temperature: float) -> RequestResult:
    start = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=row["messages"], stream=True, temperature=temperature,
            max_tokens=row.get("max_tokens", max_tokens),
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
    except Exception as exc:  # counted, never raised: a benchmark must survive a bad server
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    end = time.perf_counter()
    if not arrivals:
        return RequestResult(ok=False, error="no content received", e2e_s=end - start)
    itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return RequestResult(ok=True, ttft_s=arrivals[0] - start, itl_s=itl, e2e_s=end - start,
                         output_tokens=usage_tokens or len(arrivals))


async def scrape_specserve(http, base_url: str) -> dict | None:
    """specserve's counters, or None if the server is not specserve (or has no /metrics)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = await http.get(root + "/metrics", timeout=10)
    except Exception:
        return None
    if r.status_code != 200 or "specserve:" not in r.text:
        return None
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("specserve:") and " " in line:
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def spec_delta(before: dict | None, after: dict | None, k_samples: list[float]) -> dict | None:
    if not before or not after:
        return None

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafted = d("specserve:spec_decode_num_draft_tokens_total")
    verifications = d("specserve:spec_decode_accepted_length_count")
    return {
        "acceptance_rate": d("specserve:spec_decode_num_accepted_tokens_total") / drafted
        if drafted else None,
        "mean_accepted_length": d("specserve:spec_decode_accepted_length_sum") / verifications
        if verifications else None,
        "mean_k": statistics.fmean(k_samples) if k_samples else None,
        "draft_tokens": drafted,
    }


async def run_level(client, http, args, rows: list[dict], concurrency: int | None,
                    rate: float | None, progress) -> LevelResult:
    before = await scrape_specserve(http, args.base_url)
    k_samples: list[float] = []
    stop = asyncio.Event()

    async def sample_k():
        while not stop.is_set():
            values = await scrape_specserve(http, args.base_url)
            if values and values.get("specserve:num_requests_running", 0) > 0:
                k_samples.append(values.get("specserve:spec_decode_k", 0.0))
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    sampler = asyncio.create_task(sample_k()) if before is not None else None
    results: list[RequestResult] = []

    async def run(row):
        res = await one_request(client, args.model, row, args.max_tokens, args.temperature)
        results.append(res)
        progress.update(1)

    t0 = time.perf_counter()
    if rate:
        rng = random.Random(args.seed)
        tasks = []
        for row in rows:
            tasks.append(asyncio.create_task(run(row)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    else:
        queue = list(rows)

        async def worker():
            while queue:
                await run(queue.pop(0))

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    duration = time.perf_counter() - t0
    stop.set()
    if sampler:
        await sampler
    after = await scrape_specserve(http, args.base_url)
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    label = f"rate {rate}/s" if rate else f"concurrency {concurrency}"
    return LevelResult(
        label=label, concurrency=concurrency, request_rate=rate, num_requests=len(results),
        errors=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_tokens_per_s=tokens / duration,
        output_tokens=tokens, ttft=percentiles([r.ttft_s for r in ok]),
        itl=percentiles([x for r in ok for x in r.itl_s]), e2e=percentiles([r.e2e_s for r in ok]),
        spec=spec_delta(before, after, k_samples))


async def run_benchmark(args) -> list[LevelResult]:
    import httpx
    from openai import AsyncOpenAI
    from tqdm import tqdm

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none",
                         max_retries=0, timeout=args.timeout)
    levels: list[tuple[int | None, float | None]]
    if args.request_rate:
        levels = [(None, args.request_rate)]
    else:
        levels = [(int(c), None) for c in str(args.concurrency).split(",")]
    out = []
    async with httpx.AsyncClient() as http:
        if not args.model:
            models = await client.models.list()
            args.model = models.data[0].id
        for concurrency, rate in levels:
            n = args.num_prompts or max(4, concurrency or 4)
            rows = load_dataset(args.dataset, n, args.seed)
            label = f"rate {rate}/s" if rate else f"c={concurrency}"
            with tqdm(total=n, desc=label, unit="req") as progress:
                out.append(await run_level(client, http, args, rows, concurrency, rate,
                                           progress))
    await client.close()
    return out


# -- reporting ---------------------------------------------------------------------------------

def table(results: list[LevelResult]) -> str:
    head = ("| level | requests | errors | req/s | output tok/s | TTFT p50 / p95 (s) | "
            "ITL p50 / p95 (ms) | e2e p50 / p95 (s) | acceptance | accepted len | mean k |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        s = r.spec or {}
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"| {r.label} | {r.num_requests} | {r.errors} | {r.request_throughput:.2f} | "
            f"{r.output_tokens_per_s:.2f} | {r.ttft['median']:.2f} / {r.ttft['p95']:.2f} | "
            f"{r.itl['median'] * 1e3:.0f} / {r.itl['p95'] * 1e3:.0f} | "
            f"{r.e2e['median']:.2f} / {r.e2e['p95']:.2f} | {fmt(s.get('acceptance_rate'))} | "
            f"{fmt(s.get('mean_accepted_length'))} | {fmt(s.get('mean_k'))} |")
    return "\n".join(lines)


def load_results(folder: Path) -> tuple[str, list[dict]]:
    data = json.loads((folder / "results.json").read_text())
    return data.get("label") or folder.name, data["levels"]


def plot(runs: list[tuple[str, list[dict]]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    x_of = lambda lv: lv["concurrency"] or lv["request_rate"]  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, levels in runs:
        ax.plot([x_of(lv) for lv in levels], [lv["output_tokens_per_s"] for lv in levels],
                marker="o", label=label)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out_dir / "tokens_per_s.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, levels in runs:
        xs = [x_of(lv) for lv in levels]
        line, = ax.plot(xs, [lv["itl"]["median"] * 1e3 for lv in levels], marker="o",
                        label=f"{label} p50")
        ax.plot(xs, [lv["itl"]["p95"] * 1e3 for lv in levels], marker="x", linestyle="--",
                color=line.get_color(), label=f"{label} p95")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("Inter-token latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / "itl.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(args, results: list[LevelResult]) -> Path:
    import datetime
    import platform

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [asdict(r) for r in results]
    meta = {"label": args.label or out_dir.name, "base_url": args.base_url, "model": args.model,
            "dataset": args.dataset, "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.node()}"}
    (out_dir / "results.json").write_text(json.dumps({**meta, "levels": levels}, indent=2))
    runs = [(meta["label"], levels)] + [load_results(Path(d)) for d in args.compare or []]
    plots = plot(runs, out_dir)
    md = [f"# Serving benchmark: {meta['label']}", "",
          f"- date: {meta['date']}", f"- target: {args.base_url}, model {args.model}",
          f"- dataset: {args.dataset}, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}", f"- command: `{args.command}`", "",
          table(results), ""] + [f"![{p.stem}]({p.name})" for p in plots]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    return out_dir


def main(args) -> int:
    results = asyncio.run(run_benchmark(args))
    print(table(results))
    out_dir = write_outputs(args, results)
    print(f"results in {out_dir}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", default="bench/prompts/chat.jsonl",
                        help="a .jsonl of chat prompts, or random:IN_WORDS,OUT_TOKENS")
    parser.add_argument("--concurrency", default="1,2,4,8,16",
                        help="comma-separated concurrency levels")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals per second instead of concurrency levels")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per level (default: max(4, concurrency))")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default=None, help="name of this run in plots")
    parser.add_argument("--compare", nargs="*", help="earlier result folders to overlay")
    parser.add_argument("--out", default="bench/results/serve")


if __name__ == "__main__":
    import argparse
    import sys

    cli = argparse.ArgumentParser(description="serving benchmark against an OpenAI-compatible "
                                              "server (concurrency sweep, TTFT/ITL/throughput)")
    add_arguments(cli)
    cli_args = cli.parse_args()
    cli_args.command = " ".join(["python", "bench/serving_client.py", *sys.argv[1:]])
    sys.exit(main(cli_args))
