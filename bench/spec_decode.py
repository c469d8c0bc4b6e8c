"""Speculative decoding benchmark on the packaged Qwen2.5-Coder pair, in ONE run.

(a) plain decoding with our engine, (b) our speculative decoding (draft model, adaptive k),
greedy, (c) ours at temperature 0.7, seeded, coupled verification (the default), (d)
transformers `generate(assistant_model=draft)` with the same models and dtypes, (e)-(g) seeded
sampling at temperature 0.7 with rejection verification and at 1.0 with each (the cost of
determinism), (h)-(i) plain and speculative greedy with `batch_invariant` off (the cost of
batch invariance, which every other case has on), then a concurrency sweep 1, 2, 4, 8, 16:
adaptive speculation vs plain, aggregate tokens/s. Cases (a)-(i) run the prompts of
bench/prompts/chat.jsonl one at a time (128 new tokens each). Greedy identity: the token ids of
(b) against (a), and of (i) against (h).

    python bench/spec_decode.py [--dtype bfloat16] [--draft-quantization int4] [--quick]

Prints a table, ends with a RESULT line, writes bench/results/spec_decode.md.
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

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from results_file import write_results  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def load_prompts(tok, path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for r in rows]


def make_engine(target, draft, tok, args, speculative: bool, verification: str = "coupled",
                batch_invariant: bool = True):
    cfg = SpeculativeConfig(method="draft_model" if speculative else "none", draft_model=DRAFT,
                            k_max=args.k_max, adaptive=True,
                            draft_quantization=args.draft_quantization,
                            verification=verification)
    return LLMEngine(EngineConfig(kv_cache_memory_gb=1.5, max_num_seqs=32,
                                  max_num_batched_tokens=512, speculative=cfg,
                                  batch_invariant=batch_invariant),
                     model=target, tokenizer=tok, draft_model=draft if speculative else None)


def run_one_at_a_time(engine, prompts, params, outputs: list | None = None):
    tokens, t0 = 0, time.perf_counter()
    for p in prompts:
        ids = engine.generate([p], params)[0].output_token_ids
        tokens += len(ids)
        if outputs is not None:
            outputs.append(ids)
    return tokens, time.perf_counter() - t0


def run_concurrent(engine, prompts, params):
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.output_token_ids) for o in outs), time.perf_counter() - t0


def spec_row(name, engine, tokens, seconds):
    st = engine.speculator.stats if engine is not None else None
    return {"case": name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "accepted_len": st.mean_accepted_length if st else None,
            "acceptance": st.acceptance_rate if st else None,
            "mean_k": st.mean_k if st else None}


def hf_assisted(target, draft, prompts, max_new):
    tokens, t0 = 0, time.perf_counter()
    for p in prompts:
        out = target.generate(torch.tensor([p]), assistant_model=draft, do_sample=False,
                              max_new_tokens=max_new, min_new_tokens=max_new,
                              pad_token_id=0)
        tokens += out.shape[1] - len(p)
    return tokens, time.perf_counter() - t0


def ideal_speedup(engine) -> float:
    """Speedup the measured acceptance allows when a step costs only its forward passes: the
    tokens each verification emitted (measured) over its cost (the measured draft time per
    verification plus one target pass over 1 + k tokens, from the engine's measured cost table),
    relative to one plain target pass per token. Everything else in a step (scheduling,
    sampling, verification bookkeeping) is what keeps the measured speedup below it."""
    ctl, st = engine.speculator.guard.controller, engine.speculator.stats
    k = st.num_draft_tokens / max(st.num_drafts, 1)  # mean drafts per verification
    step_seconds = ctl.target_cost(1 + k) + st.draft_seconds / max(st.num_drafts, 1)
    return st.mean_accepted_length * ctl.target_cost(1) / step_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="target and draft dtype")
    parser.add_argument("--draft-quantization", default="int4",
                        choices=["none", "int8", "int4", "auto"])
    parser.add_argument("--k-max", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sweep-max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sweep-repeats", type=int, default=2, choices=[1, 2],
                        help="2: each level runs plain, spec, spec, plain and sums")
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts" / "chat.jsonl"))
    parser.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, sweep 1,2")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_decode.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tok = load_model(TARGET, dtype=args.dtype, device="cpu")
    draft, _ = load_model(DRAFT, dtype=args.dtype, device="cpu")
    prompts = load_prompts(tok, args.prompts)
    levels = [1, 2, 4, 8, 16]
    if args.quick:
        prompts, args.max_tokens, args.sweep_max_tokens, levels = prompts[:2], 32, 16, [1, 2]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    rows, outputs = [], {}
    # greedy, plain and speculative, with batch invariance on (the default) and off; the off
    # engines get their own copy of the target (the rule is installed on the model it runs)
    target_off, _ = load_model(TARGET, dtype=args.dtype, device="cpu")
    ideal = None
    for case, speculative, invariant in (("(a)", False, True), ("(b)", True, True),
                                         ("(h)", False, False), ("(i)", True, False)):
        engine = make_engine(target if invariant else target_off,
                             draft if speculative else None, tok, args,
                             speculative=speculative, batch_invariant=invariant)
        if not speculative:  # warm up
            run_one_at_a_time(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=4))
        name = (f"{case} {'speculative' if speculative else 'plain'}, greedy"
                f"{'' if invariant else ', batch_invariant off'}")
        outputs[case] = []
        rows.append(spec_row(name, engine,
                             *run_one_at_a_time(engine, prompts, greedy, outputs[case])))
        if case == "(a)":
            invariance = engine.runner.invariance  # the first engine measured the rule
        if case == "(b)":
            draft_used = engine.speculator.proposer.runner.model  # quantized when asked
            ideal = ideal_speedup(engine)
        del engine
        gc.collect()
    identical = sum(a == b for a, b in zip(outputs["(a)"], outputs["(b)"]))
    identical_off = sum(a == b for a, b in zip(outputs["(h)"], outputs["(i)"]))
    # seeded sampling: coupled verification (the default: output identical to plain seeded
    # sampling) against rejection sampling (higher acceptance, output depends on the drafts)
    for case, temperature, verification in (("(c)", 0.7, "coupled"), ("(e)", 0.7, "rejection"),
                                            ("(f)", 1.0, "coupled"), ("(g)", 1.0, "rejection")):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                ignore_eos=True, seed=0)
        spec_engine = make_engine(target, draft, tok, args, speculative=True,
                                  verification=verification)
        rows.append(spec_row(f"{case} speculative, seeded, temperature {temperature}, "
                             f"{verification} verification", spec_engine,
                             *run_one_at_a_time(spec_engine, prompts, params)))
        del spec_engine
        gc.collect()

    rows.append(spec_row("(d) transformers assisted generation", None,
                         *hf_assisted(target_off, draft_used, prompts, args.max_tokens)))
    del target_off  # transformers ran the target without our batch-invariance rule
    gc.collect()

    sweep = []
    sweep_params = SamplingParams(temperature=0, max_tokens=args.sweep_max_tokens,
                                  ignore_eos=True)
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        totals = {False: [0, 0.0], True: [0, 0.0]}  # speculative? -> tokens, seconds
        ks, acceptance = [], []
        # plain, spec, spec, plain: a drift in machine speed during the level hits both alike
        for speculative in (False, True, True, False)[:4 if args.sweep_repeats > 1 else 2]:
            engine = make_engine(target, draft if speculative else None, tok, args,
                                 speculative=speculative)
            n, seconds = run_concurrent(engine, batch, sweep_params)
            totals[speculative][0] += n
            totals[speculative][1] += seconds
            if speculative:
                ks.append(engine.speculator.stats.mean_k)
                acceptance.append(engine.speculator.stats.acceptance_rate)
            del engine
            gc.collect()
        plain_rate, spec_rate = (totals[s][0] / totals[s][1] for s in (False, True))
        sweep.append({"concurrency": c, "plain_tok_s": plain_rate, "spec_tok_s": spec_rate,
                      "ratio": spec_rate / plain_rate, "mean_k": sum(ks) / len(ks),
                      "acceptance": sum(acceptance) / len(acceptance)})

    rows.sort(key=lambda r: r["case"])
    tok_s = {r["case"][:3]: r["tok_s"] for r in rows}
    speedup = tok_s["(b)"] / tok_s["(a)"]
    # the cost of batch invariance: tokens/s off over on, the worse of plain and speculative
    cost_plain, cost_spec = tok_s["(h)"] / tok_s["(a)"], tok_s["(i)"] / tok_s["(b)"]
    result = (f"RESULT bf16_greedy_identical={identical}/{len(prompts)} "
              f"invariance_cost={max(cost_plain, cost_spec):.2f} "
              f"speedup_greedy={speedup:.2f} speedup_t07={tok_s['(c)'] / tok_s['(a)']:.2f} "
              f"vs_hf_assisted={tok_s['(b)'] / tok_s['(d)']:.2f} "
              f"worst_sweep_ratio={min(s['ratio'] for s in sweep):.2f} "
              f"ideal_fraction={speedup / ideal:.2f} "
              f"coupled_vs_rejection_tps={tok_s['(c)'] / tok_s['(e)']:.2f} "
              f"coupled_vs_rejection_tps_t1={tok_s['(f)'] / tok_s['(g)']:.2f}")

    fmt = lambda v, spec="{:.2f}": "-" if v is None else spec.format(v)  # noqa: E731
    lines = ["| case | tokens | seconds | tokens/s | mean accepted length | acceptance | mean k |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['tokens']} | {r['seconds']:.1f} | {r['tok_s']:.2f} | "
              f"{fmt(r['accepted_len'])} | {fmt(r['acceptance'])} | {fmt(r['mean_k'])} |"
              for r in rows]
    lines += ["", "| concurrency | plain tokens/s | speculative tokens/s | ratio | mean k | "
              "acceptance |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['concurrency']} | {s['plain_tok_s']:.2f} | {s['spec_tok_s']:.2f} | "
              f"{s['ratio']:.2f} | {s['mean_k']:.2f} | {s['acceptance']:.2f} |" for s in sweep]
    table = "\n".join(lines)
    print(table)
    invariance_line = (
        f"batch invariance: greedy speculative == plain on {identical}/{len(prompts)} prompts "
        f"with it on, {identical_off}/{len(prompts)} with it off; tokens/s off / on: plain "
        f"{cost_plain:.2f}, speculative {cost_spec:.2f}; start-up check "
        f"{invariance.seconds:.2f} s, linear row ranges "
        f"{sorted(set(invariance.linear_rows.values()), key=str)}, "
        f"attention {invariance.attention}, invariant={invariance.invariant}")
    print(f"ideal speedup from measured acceptance and step costs: {ideal:.2f}")
    print(invariance_line)
    print(result)
    quantized = ("" if args.draft_quantization == "none"
                 else f" with {args.draft_quantization} linears")
    write_results(args.out, "Speculative decoding", args.threads, [
        f"target {TARGET} {args.dtype}; draft {DRAFT} {args.dtype}{quantized}; "
        f"the same draft object for transformers' assisted generation",
        f"{len(prompts)} chat prompts from {Path(args.prompts).relative_to(ROOT)}, "
        f"{args.max_tokens} new tokens each, one request at a time for (a)-(i); the sweep "
        f"runs `concurrency` requests at once, {args.sweep_max_tokens} new tokens each"
        f"{', plain/spec/spec/plain per level, summed' if args.sweep_repeats > 1 else ''}",
        f"ideal speedup from measured acceptance and step costs: {ideal:.2f}", invariance_line],
        table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
