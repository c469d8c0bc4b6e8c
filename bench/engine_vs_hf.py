"""Engine vs transformers `generate`, greedy, fp32, on real packaged models.

(a) one request, 128 new tokens, vs `generate`;
(b) 16 requests as real traffic looks (a fixed, seeded mix of prompt lengths 16..512 and
    max_tokens 32..256) vs one left-padded `generate` batch of 16 (run to the largest
    max_tokens, counting only each request's own tokens) and vs 16 serial `generate` calls.
Tokens/s counts generated tokens only. Greedy outputs are compared with the serial `generate`
outputs, request by request.

    python bench/engine_vs_hf.py [--models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct]

Prints a table, ends with a RESULT line, writes bench/results/engine_vs_hf.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from results_file import write_results  # noqa: E402

TEXT = """specserve is an OpenAI-compatible inference server whose engine does speculative decoding.
Continuous batching keeps the accelerator busy by admitting new requests as soon as others
finish. Paged attention stores keys and values in fixed-size blocks so that memory is not
reserved for the longest possible sequence. Speculative decoding proposes several tokens with a
cheap draft and verifies them with one pass of the target model.
def quicksort(xs):
    if len(xs) <= 1:
        return xs
    pivot, rest = xs[0], xs[1:]
    return quicksort([x for x in rest if x < pivot]) + [pivot] + quicksort([x for x in rest if x >= pivot])
"""


def traffic(tokenizer, n=16, seed=0):
    """Fixed, seeded mix: prompt lengths 16..512, max_tokens 32..256."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    out = []
    for _ in range(n):
        length = rng.randint(16, 512)
        start = rng.randint(0, len(ids) - length)
        out.append((ids[start:start + length], rng.randint(32, 256)))
    return out


def hf_generate(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_padded_batch(model, reqs, pad_id):
    width = max(len(p) for p, _ in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    max_new = max(m for _, m in reqs)
    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                   min_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_id)


def ours(engine, reqs):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    return [o.output_token_ids for o in engine.generate([p for p, _ in reqs], params)]


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def bench_model(name, args):
    ref, tok = load_model(name, dtype="float32", device="cpu")
    mine, _ = load_model(name, dtype="float32", device="cpu")
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=16,
                                    kv_cache_memory_gb=2.0), model=mine, tokenizer=tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows, matches = [], 0
    single = traffic(tok, 1, seed=1)[0][0][:64], 128
    # warm-up both paths once (allocator, thread pools)
    hf_generate(ref, single[0], 4)
    ours(engine, [(single[0], 4)])

    t_hf, hf_out = timed(lambda: hf_generate(ref, *single))
    t_us, us_out = timed(lambda: ours(engine, [single]))
    matches += us_out[0] == hf_out
    rows.append((name, "single (1 x 128)", 128 / t_hf, 128 / t_us, "hf generate"))

    reqs = traffic(tok, 16, seed=2)
    n_tokens = sum(m for _, m in reqs)
    t_us, us_out = timed(lambda: ours(engine, reqs))
    t_pad, _ = timed(lambda: hf_padded_batch(ref, reqs, pad_id))
    t_ser, ser_out = timed(lambda: [hf_generate(ref, p, m) for p, m in reqs])
    matches += sum(a == b for a, b in zip(us_out, ser_out))
    rows.append((name, "16 mixed vs padded batch", n_tokens / t_pad, n_tokens / t_us,
                 "hf generate, left-padded batch of 16"))
    rows.append((name, "16 mixed vs serial", n_tokens / t_ser, n_tokens / t_us,
                 "hf generate x16, one after another"))
    return rows, matches, 17


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+",
                        default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=512, help="engine token budget per step")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_vs_hf.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    all_rows, matches, total = [], 0, 0
    for name in args.models:
        rows, m, n = bench_model(name, args)
        all_rows += rows
        matches += m
        total += n
    header = "| model | case | baseline tok/s | specserve tok/s | ratio | baseline |\n|---|---|---|---|---|---|"
    lines = [header] + [f"| {m} | {c} | {b:.1f} | {o:.1f} | {o / b:.2f} | {what} |"
                        for m, c, b, o, what in all_rows]
    ratio = lambda key: min(o / b for _, c, b, o, _ in all_rows if key in c)  # noqa: E731
    result = (f"RESULT single_ratio={ratio('single'):.2f} batch16_ratio={ratio('padded'):.2f} "
              f"serial16_ratio={ratio('serial'):.2f} greedy_match={matches}/{total}")
    table = "\n".join(lines)
    print(table)
    print(result)
    write_results(args.out, "Engine vs transformers generate", args.threads,
                  [platform.platform(), "fp32, greedy; ratios are the minimum over models"],
                  table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
