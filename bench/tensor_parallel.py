"""Tensor parallelism on this machine: the packaged pair with the target split over 1 and 2
ranks, in ONE run.

For each tensor_parallel_size (1, then 2: one process per rank, the cores shared out, gloo), the
engine `make serve` runs (int4 target and draft on the CPU with `--quantization auto`, hybrid
speculation) and the same target plain; the chat prompts of bench/prompts/chat.jsonl one at a
time (c = 1) and all at once (c = all), greedy. Greedy identity: TP=2's plain tokens against
TP=1's (the order of the row-parallel sums differs, so low bits may), and each size's
speculative tokens against its own plain ones (must be equal).

    python bench/tensor_parallel.py [--quantization auto|none] [--max-tokens 64] [--prompts 8]

Prints a table, ends with a RESULT line, writes bench/results/tensor_parallel_cpu.md (or
tensor_parallel_<device>.md).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.models.loader import load_tokenizer  # noqa: E402
from results_file import write_results  # noqa: E402
from spec_methods import DRAFT, TARGET, load_prompts  # noqa: E402


def make_engine(size: int, speculative: bool, args) -> LLMEngine:
    spec = SpeculativeConfig(method="hybrid" if speculative else "none",
                             draft_model=DRAFT if speculative else None, k_max=6,
                             adaptive=True, draft_quantization=args.quantization,
                             draft_vocab_size=32768 if speculative else 0)
    return LLMEngine(EngineConfig(model=TARGET, dtype="bfloat16", device=args.device,
                                  quantization=args.quantization, kv_cache_memory_gb=1.0,
                                  max_num_seqs=32, max_num_batched_tokens=512,
                                  tensor_parallel_size=size, speculative=spec))


def timed(engine: LLMEngine, prompts, params, at_once: bool):
    """(tokens per second, token ids per prompt)."""
    t0 = time.perf_counter()
    if at_once:
        outs = engine.generate(prompts, params)
    else:
        outs = [engine.generate([p], params)[0] for p in prompts]
    seconds = time.perf_counter() - t0
    tokens = [o.output_token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto", choices=["auto", "int4", "none"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--sizes", default="1,2")
    args = ap.parse_args()
    tok = load_tokenizer(TARGET)
    prompts = load_prompts(tok, ROOT / "bench/prompts/chat.jsonl")[:args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rates, tokens, threads = {}, {}, {}
    for size in sizes:
        for speculative in (False, True):
            name = f"tp{size} {'hybrid' if speculative else 'plain'}"
            t0 = time.perf_counter()
            engine = make_engine(size, speculative, args)
            print(f"{name}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
            threads[size] = torch.get_num_threads()
            try:
                timed(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8),
                      False)  # warm-up
                for at_once in (False, True):
                    rate, out = timed(engine, prompts, params, at_once)
                    key = (size, speculative, at_once)
                    rates[key], tokens[key] = rate, out
                    print(f"  c={'all' if at_once else 1}: {rate:.2f} tok/s", flush=True)
            finally:
                engine.close()
                del engine
                gc.collect()
    rows = ["| ranks | case | c = 1 tok/s | c = all tok/s | vs TP=1 (c = 1) | vs TP=1 (c = all) |",
            "|---|---|---|---|---|---|"]
    for size in sizes:
        for spec in (False, True):
            one, many = rates[(size, spec, False)], rates[(size, spec, True)]
            base1, base_all = rates[(sizes[0], spec, False)], rates[(sizes[0], spec, True)]
            rows.append(f"| {size} | {'hybrid' if spec else 'plain'} | {one:.2f} | {many:.2f} | "
                        f"{one / base1:.2f} | {many / base_all:.2f} |")
    table = "\n".join(rows)
    last = sizes[-1]
    plain_one, plain_last = tokens[(sizes[0], False, False)], tokens[(last, False, False)]
    same = sum(a == b for a, b in zip(plain_one, plain_last))
    prefix = [common_prefix(a, b) for a, b in zip(plain_one, plain_last)]
    exact = all(tokens[(s, True, c)] == tokens[(s, False, False)]
                for s in sizes for c in (False, True)) and all(
        tokens[(s, False, True)] == tokens[(s, False, False)] for s in sizes)
    identity = (f"greedy identity: TP={last} plain == TP={sizes[0]} plain on {same} of "
                f"{len(prompts)} prompts (common prefix per prompt {prefix} of "
                f"{args.max_tokens} tokens); speculative == plain and batched == alone at every "
                f"size: {exact}")
    print(table)
    print(identity)
    result = (f"RESULT tp{last}_vs_tp1_plain_c1={rates[(last, False, False)] / rates[(sizes[0], False, False)]:.2f} "
              f"tp{last}_vs_tp1_plain_call={rates[(last, False, True)] / rates[(sizes[0], False, True)]:.2f} "
              f"tp{last}_vs_tp1_hybrid_c1={rates[(last, True, False)] / rates[(sizes[0], True, False)]:.2f} "
              f"tp{last}_greedy_same_as_tp1={same}/{len(prompts)} spec_equals_plain={exact}")
    print(result)
    device = "cpu" if args.device == "cpu" else "gpu"
    write_results(ROOT / f"bench/results/tensor_parallel_{device}.md",
                  "Tensor parallelism: the packaged pair over 1 and 2 ranks",
                  threads[sizes[0]],
                  [f"target {TARGET}, draft {DRAFT}, quantization {args.quantization}, bf16 "
                   f"activations; {len(prompts)} chat prompts, {args.max_tokens} new tokens, "
                   f"greedy; torch threads per rank: "
                   + ", ".join(f"TP={s}: {threads[s]}" for s in sizes),
                   identity], table, result)


if __name__ == "__main__":
    main()
