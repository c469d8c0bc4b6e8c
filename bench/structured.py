"""The cost of structured output: tokens/s of json_schema requests vs the same requests
unconstrained, speculation on (the default Qwen2.5-Coder pair, bf16 target, int4 draft), at
concurrency 1 (the requests one at a time) and 8 (all at once), in ONE run; with acceptance.

    python bench/structured.py [--quick]

Each of the 8 prompts asks for a JSON description of something and is sent with a JSON schema
(bench/prompts/structured.jsonl: prompt and schema, written for this benchmark) and without
one. Prints a table, ends with a RESULT line, writes bench/results/structured.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, LLMEngine, SamplingParams, structured  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from results_file import write_results  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def run(engine, prompts, params, concurrency):
    """(tokens, seconds, outputs) for the prompts, `concurrency` at a time."""
    tokens, outputs, t0 = 0, [], time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        outs = engine.generate(prompts[lo:lo + concurrency], params[lo:lo + concurrency])
        tokens += sum(len(o.output_token_ids) for o in outs)
        outputs += outs
    return tokens, time.perf_counter() - t0, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 prompts, c=1 and 2")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tok = load_model(TARGET, dtype="bfloat16", device="cpu")
    draft, _ = load_model(DRAFT, dtype="bfloat16", device="cpu")
    rows = [json.loads(line) for line in
            (ROOT / "bench" / "prompts" / "structured.jsonl").read_text().splitlines() if line]
    levels = [1, 8]
    if args.quick:
        rows, levels = rows[:2], [1, 2]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for r in rows]
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  grammar=structured.json_schema(r["schema"])) for r in rows]
    free = [SamplingParams(temperature=0, max_tokens=args.max_tokens)] * len(rows)
    spec = SpeculativeConfig(method="draft_model", draft_model=DRAFT, k_max=6,
                             draft_quantization="int4")
    engine = LLMEngine(EngineConfig(kv_cache_memory_gb=1.5, max_num_seqs=32,
                                    max_num_batched_tokens=512, speculative=spec),
                       model=target, tokenizer=tok, draft_model=draft)
    run(engine, prompts[:1], [SamplingParams(temperature=0, max_tokens=4)], 1)  # warm up

    results, valid = [], 0
    for c in levels:
        # unconstrained, constrained, constrained, unconstrained: drift hits both alike
        totals = {False: [0, 0.0, 0, 0], True: [0, 0.0, 0, 0]}  # tokens, s, drafted, accepted
        for grammar in (False, True, True, False):
            st = engine.speculator.stats
            before = (st.num_draft_tokens, st.num_accepted_tokens)
            n, seconds, outs = run(engine, prompts, constrained if grammar else free, c)
            total = totals[grammar]
            total[0] += n
            total[1] += seconds
            total[2] += st.num_draft_tokens - before[0]
            total[3] += st.num_accepted_tokens - before[1]
            if grammar:
                for o, r in zip(outs, rows):
                    try:
                        import jsonschema

                        jsonschema.validate(json.loads(o.text), r["schema"])
                        valid += 1
                    except Exception:  # noqa: BLE001 - counted: a cut or invalid answer
                        pass
        rate = {g: totals[g][0] / totals[g][1] for g in totals}
        acceptance = {g: totals[g][3] / max(totals[g][2], 1) for g in totals}
        results.append({"c": c, "free": rate[False], "json": rate[True],
                        "ratio": rate[True] / rate[False], "acc_free": acceptance[False],
                        "acc_json": acceptance[True]})
        gc.collect()

    mask_s = engine.grammar_mask_seconds
    lines = ["| concurrency | unconstrained tokens/s | json_schema tokens/s | ratio | "
             "acceptance unconstrained | acceptance json_schema |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['c']} | {r['free']:.2f} | {r['json']:.2f} | {r['ratio']:.2f} | "
              f"{r['acc_free']:.2f} | {r['acc_json']:.2f} |" for r in results]
    table = "\n".join(lines)
    runs = 2 * len(levels) * len(rows)
    result = (f"RESULT grammar_overhead={min(r['ratio'] for r in results):.2f} "
              f"valid_json={valid}/{runs}")
    print(table)
    print(f"grammar mask time: {mask_s:.2f} s in all")
    print(result)
    write_results(args.out, "Structured output", args.threads, [
        f"target {TARGET} bf16, draft {DRAFT} with int4 linears, speculation on "
        f"(adaptive k, k_max 6), greedy, {args.max_tokens} new tokens at most",
        f"{len(rows)} prompts from bench/prompts/structured.jsonl, each with and without its "
        f"JSON schema; per concurrency: unconstrained, constrained, constrained, "
        f"unconstrained, summed",
        f"grammar mask time: {mask_s:.2f} s in all; grammar_overhead is the worst ratio"],
        table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
