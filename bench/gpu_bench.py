"""GPU benchmark (part of `make gpu-check`): our engine against transformers, the bandwidth
roofline, and speculation against its ideal, on random-init models with real shapes.

No weights travel to the GPU machine: the models are random-init with the configurations of
Qwen2.5-Coder-1.5B (target), Qwen2.5-Coder-0.5B (draft) and a Qwen2.5-7B-shaped target
(bench/model_shapes/), bf16. Random weights cost what trained ones cost per token; only
acceptance needs care, so speculation runs with draft = a copy of the target's own weights
(greedy acceptance 1: the verification machinery against its ideal) and with an unrelated
random draft (acceptance ~0: adaptive k must fall back to plain decoding).

Cases, prompt 512 random tokens, 256 new tokens, greedy, ignore_eos:
- ours, plain decode tokens/s at batch 1, 8, 32, 128 (decode only: timed after every sequence
  has its first token), and end to end (prompt included) at 32;
- transformers `generate` with a static cache and `torch.compile(mode="reduce-overhead")`
  (the gpt-fast recipe), batch 1, decode tokens/s (256 new tokens minus 1 new token);
- transformers continuous batching (`generate_batch`, paged attention), batch 32, end to end;
- the roofline: (weight bytes + KV bytes read per step) over the measured device copy
  bandwidth, per batch size;
- split-KV attention (`attention_kv_split` 512 against 0) at prompt 4096, 64 new tokens,
  batch 1 and 8, decode tokens/s (CUDA only: the triton backend);
- tensor parallelism, where the machine has 2 GPUs: the 1.5B shape over 2 ranks against 1,
  eager, batch 1 and 32 (RESULT `tp2_vs_tp1_b1`, reported);
- speculation at batch 1: the target's own weights as draft with k = 4 fixed, against the
  ideal its measured forward costs allow ((k + 1) tokens per target pass of k + 1 tokens plus
  k draft forwards of one); an unrelated random draft with adaptive k, against plain;
- the packaged pair's speedup at batch 1, MODELLED (its weights do not travel): the forward
  costs of the 1.5B and 0.5B shapes measured here with the tokens per target pass the real
  pair reaches (--pair-accepted at --pair-k: bench/results/spec_decode.md, greedy chat, bf16),
  RESULT `spec_b1_vs_plain_modelled`;
- where a batch-1 step's time goes: 64 decode steps of the 1.5B shape (CUDA graphs) under
  torch.profiler, split into device busy / device idle / host blocked / host work and the
  engine's phases, with the kernels by device time (bench/profile_trace.py; --trace keeps
  the trace).

    python bench/gpu_bench.py [--out bench/results/gpu/gpu_bench.md] [--trace FILE.json.gz]
                              [--smoke]

--smoke runs every case on tiny shapes (CPU allowed, torch.compile skipped): a check that the
script works, not a measurement. Prints a table and a RESULT line; writes --out.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from profile_trace import profile_steps, table as profile_table  # noqa: E402
from results_file import write_results  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.batch import RunItem  # noqa: E402

SMOKE_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}


class Clock:
    """Wall seconds with the device synchronized at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def build(shape: str, device: torch.device, seed: int, smoke: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ROOT / "bench/model_shapes" / f"{shape}.json").read_text())
    if smoke:
        cfg.update(SMOKE_SHAPE)
    config = AutoConfig.for_model(**cfg)
    config.eos_token_id = None  # random weights: never stop early
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2


def copy_bandwidth(device: torch.device, clock: Clock, mib: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(5):
            y.copy_(x)
        best = min(best, (clock() - t0) / 5)
    return 2 * x.numel() / best


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def engine_for(model, args, spec: SpeculativeConfig | None = None, draft=None,
               graphs: str = "auto", kv_split: int = 0,
               batch_sizes: list[int] | None = None) -> LLMEngine:
    extra = {"cuda_graph_batch_sizes": batch_sizes} if batch_sizes else {}
    return LLMEngine(EngineConfig(max_num_seqs=128, max_num_batched_tokens=8192,
                                  kv_cache_memory_gb=args.kv_gb, enable_prefix_caching=False,
                                  cuda_graphs=graphs, attention_kv_split=kv_split,
                                  speculative=spec or SpeculativeConfig(), **extra),
                     model=model, draft_model=draft)


def ours(engine: LLMEngine, batch: int, args, clock: Clock, seed: int) -> dict:
    """Decode tokens/s (after every sequence's first token) and end-to-end tokens/s."""
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    vocab = engine.vocab_size
    t_start = clock()
    for p in prompts(batch, args.prompt_len, vocab, seed):
        engine.add_request(p, params)
    started, generated, before = set(), 0, 0
    while len(started) < batch:
        for out in engine.step():
            started.add(out.request_id)
            generated += len(out.new_token_ids)
    before, t0 = generated, clock()
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    t1 = clock()
    return {"decode_tok_s": (generated - before) / (t1 - t0),
            "e2e_tok_s": generated / (t1 - t_start)}


def hf_static_compiled(model, args, clock: Clock) -> tuple[float, str]:
    """transformers generate, static cache (+ torch.compile on CUDA), batch 1: decode tok/s."""
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    # on CUDA, generate compiles the forward itself for a static cache (its compile_config);
    # compiling model.forward by hand as well breaks on the cache's in-place updates
    note = "static cache" + ("" if args.smoke else " + generate's own torch.compile")
    ids = torch.tensor(prompts(1, args.prompt_len, model.config.vocab_size, 7),
                       device=model.device)

    def gen(n: int) -> float:
        t0 = clock()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return clock() - t0

    for _ in range(2):  # compile and warm up both lengths
        gen(args.new_tokens)
        gen(1)
    full, one = gen(args.new_tokens), gen(1)
    return (args.new_tokens - 1) / max(full - one, 1e-9), note


def hf_continuous_batching(model, args, clock: Clock, batch: int) -> tuple[float | None, str]:
    """transformers generate_batch (paged attention), end-to-end tokens/s."""
    from transformers import GenerationConfig

    inputs = prompts(batch, args.prompt_len, model.config.vocab_size, 11)
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    errors = []
    for attn in ("sdpa_paged", "paged|sdpa", "paged_attention"):
        try:
            model.set_attn_implementation(attn)
            model.generate_batch(inputs=inputs[:2], generation_config=cfg, progress_bar=False)
            t0 = clock()
            out = model.generate_batch(inputs=inputs, generation_config=cfg,
                                       progress_bar=False)
            seconds = clock() - t0
            tokens = sum(len(r.generated_tokens) for r in out.values())
            return tokens / seconds, f"generate_batch, attn {attn}"
        except Exception as exc:  # noqa: BLE001 - an API that moved: try the next name
            errors.append(f"{attn}: {type(exc).__name__}: {str(exc)[:120]}")
    return None, "generate_batch failed: " + "; ".join(errors)


def forward_seconds(runner, ctx: int, tokens: int, clock: Clock, reps: int = 10) -> float:
    """One forward of `tokens` new tokens after `ctx` cached ones, with its greedy pick (on
    free blocks: the engine is idle)."""
    table = list(range(-(-(ctx + tokens) // runner.block_size)))
    item = RunItem([5] * tokens, ctx, table, tokens)
    runner.execute([item])
    t0 = clock()
    for _ in range(reps):
        runner.execute([item]).logits.argmax(-1).tolist()
    return (clock() - t0) / reps


def tensor_parallel(device: torch.device, args, clock: Clock, rows: list, result: dict) -> None:
    """The 1.5B shape split over 2 ranks against 1, both eager (split forwards run without
    CUDA graphs), batch 1 and 32: where the machine has 2 GPUs (or, with --smoke, 2 CPU
    cores). The whole model is built on the host: each rank moves its share to its device."""
    from engine.parallel.shard import devices

    if devices(device) < 2 or (device.type == "cpu" and not args.smoke):
        return
    shape = "qwen2.5-coder-1.5b"
    model = build(shape, torch.device("cpu"), 0, args.smoke)
    for size in (1, 2):
        try:
            engine = LLMEngine(EngineConfig(
                device=str(device), dtype="bfloat16", max_num_seqs=32,
                max_num_batched_tokens=8192, kv_cache_memory_gb=args.kv_gb / 2,
                enable_prefix_caching=False, cuda_graphs="off", tensor_parallel_size=size),
                model=model if size > 1 else copy.deepcopy(model).to(device))
        except Exception as exc:  # noqa: BLE001 - said in the results, the rest still runs
            rows.append((shape, f"ours, tensor_parallel_size {size}: failed to start "
                         f"({type(exc).__name__}: {exc})", 1, None, None, None))
            print(rows[-1], flush=True)
            return
        try:
            for b in (1, 32 if not args.smoke else 4):
                r = ours(engine, b, args, clock, seed=b)
                rows.append((shape, f"ours, eager, tensor_parallel_size {size}", b,
                             r["decode_tok_s"], None, r["e2e_tok_s"]))
                result[f"tp{size}_b{b}"] = r["decode_tok_s"]
                print(rows[-1], flush=True)
        finally:
            engine.close()
            del engine
            gc.collect()


def versions() -> str:
    import transformers

    try:
        import triton
        tri = triton.__version__
    except ImportError:
        tri = "not installed"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
            f"{transformers.__version__}, triton {tri}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results/gpu/gpu_bench.md"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trace", default=None, help="keep the batch-1 profile's trace here")
    parser.add_argument("--pair-accepted", type=float, default=3.54,
                        help="tokens per target pass of the packaged pair (greedy chat)")
    parser.add_argument("--pair-k", type=int, default=5, help="the k it was reached at")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    clock = Clock(device)
    args.prompt_len, args.new_tokens = (32, 16) if args.smoke else (512, 256)
    args.kv_gb = 0.25 if args.smoke else 16.0
    batches = (1, 4) if args.smoke else (1, 8, 32, 128)
    cb_batch = 4 if args.smoke else 32
    bw = copy_bandwidth(device, clock, 16 if args.smoke else 1024)
    rows, result, extra, profile = [], {}, {}, None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    began = time.perf_counter()

    def section(what: str) -> None:  # where the device time goes (gpu-check has 5 minutes)
        print(f"[{time.perf_counter() - began:6.1f} s] {what}", flush=True)

    print(f"device {name}, {versions()}, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    # the 1.5B shape with CUDA graphs (the default) and without; the 7B shape with them
    for shape, graphs in (("qwen2.5-coder-1.5b", "auto"), ("qwen2.5-coder-1.5b", "off"),
                          ("qwen2.5-7b", "auto")):
        section(f"{shape}, cuda_graphs {graphs}")
        model = build(shape, device, 0, args.smoke)
        wbytes, kvb = weight_bytes(model), kv_bytes_per_token(model)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine = engine_for(model, args, graphs=graphs)
        if device.type == "cuda":  # what the engine keeps beyond the weights and the KV pool
            pool = sum(t.nbytes for t in engine.runner.kv.k + engine.runner.kv.v)
            extra[f"{shape}, {graphs}"] = torch.cuda.memory_allocated(device) - held - pool
        backend = engine.runner.attention_backend
        mode = "CUDA graphs" if engine.runner.static is not None else "eager"
        for b in batches:
            r = ours(engine, b, args, clock, seed=b)
            ctx = args.prompt_len + args.new_tokens / 2
            roof = b / ((wbytes + b * ctx * kvb) / bw)
            rows.append((shape, f"ours, {mode}, {backend} attention", b, r["decode_tok_s"],
                         roof, r["e2e_tok_s"]))
            print(rows[-1], flush=True)
            if shape == "qwen2.5-coder-1.5b" and graphs == "auto":
                result[f"ours_b{b}"], result[f"roof_b{b}"] = r["decode_tok_s"], roof
                result[f"ours_e2e_b{b}"] = r["e2e_tok_s"]
        if shape == "qwen2.5-coder-1.5b" and graphs == "auto":
            section("batch-1 profile")
            steps = 8 if args.smoke else 64
            profile = profile_steps(engine, prompts(1, args.prompt_len, engine.vocab_size, 5)[0],
                                    steps=steps, warmup=4 if args.smoke else 16,
                                    trace_path=args.trace)
            profile["mode"] = f"{mode}, {backend} attention"
            print(profile_table(profile), flush=True)
        del engine, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # split-KV at a long context, batch 1 and 8: attention_kv_split 512 against one split
    # (the triton backend only: on CUDA)
    shape = "qwen2.5-coder-1.5b"
    if device.type == "cuda":
        section("split-KV")
        long = argparse.Namespace(**vars(args))
        long.prompt_len, long.new_tokens = (256, 16) if args.smoke else (4096, 64)
        model = build(shape, device, 0, args.smoke)
        for split in (0, 512):
            engine = engine_for(model, long, kv_split=split, batch_sizes=[1, 8])
            for b in (1, 8):
                r = ours(engine, b, long, clock, seed=b)
                rows.append((shape, f"ours, CUDA graphs, prompt {long.prompt_len}, "
                             f"attention_kv_split {split}", b, r["decode_tok_s"], None,
                             r["e2e_tok_s"]))
                result[f"split{split}_b{b}"] = r["decode_tok_s"]
                print(rows[-1], flush=True)
            del engine
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()

    section("transformers generate")
    hf = build(shape, device, 0, args.smoke)
    tok_s, note = hf_static_compiled(hf, args, clock)
    rows.append((shape, f"transformers generate, {note}", 1, tok_s, None, None))
    result["hf_compiled_b1"] = tok_s
    print(rows[-1], flush=True)
    del hf
    gc.collect()
    section("transformers generate_batch")
    hf = build(shape, device, 0, args.smoke)
    tok_s, note = hf_continuous_batching(hf, args, clock, cb_batch)
    rows.append((shape, f"transformers {note}", cb_batch, None, None, tok_s))
    result["hf_cb"] = tok_s
    print(rows[-1], flush=True)
    del hf
    gc.collect()

    section("speculation")
    target, same = build(shape, device, 0, args.smoke), build(shape, device, 0, args.smoke)
    fixed = SpeculativeConfig(method="draft_model", draft_model="in-memory", k_max=args.k,
                              adaptive=False, calibrate=False)
    engine = engine_for(target, args, fixed, same)
    r = ours(engine, 1, args, clock, seed=21)
    st = engine.speculator.stats
    ctx = args.prompt_len + args.new_tokens // 2
    t_verify = forward_seconds(engine.runner, ctx, args.k + 1, clock)
    t_draft = forward_seconds(engine.speculator.proposer.runner, ctx, 1, clock)
    ideal = (args.k + 1) / (t_verify + args.k * t_draft)
    rows.append((shape, (f"ours, draft = its own weights, k = {args.k} (acceptance "
                         f"{st.acceptance_rate:.3f}; ideal {ideal:.1f} tok/s)"), 1,
                 r["decode_tok_s"], None, None))
    result["spec_ideal"] = r["decode_tok_s"] / ideal
    result["spec_acceptance"] = st.acceptance_rate
    print(rows[-1], flush=True)
    del engine, same
    gc.collect()
    plain = engine_for(target, args)
    p = ours(plain, 1, args, clock, seed=21)
    del plain
    other = build("qwen2.5-coder-0.5b", device, 1, args.smoke)
    adaptive = SpeculativeConfig(method="draft_model", draft_model="in-memory", k_max=6,
                                 adaptive=True)
    engine = engine_for(target, args, adaptive, other)
    r = ours(engine, 1, args, clock, seed=21)
    st = engine.speculator.stats
    rows.append((shape, (f"ours, unrelated random draft, adaptive (acceptance "
                         f"{st.acceptance_rate:.3f}, mean k {st.mean_k:.2f})"), 1,
                 r["decode_tok_s"], None, None))
    rows.append((shape, "ours, plain (same run as the line above)", 1, p["decode_tok_s"],
                 None, None))
    result["spec_off"] = r["decode_tok_s"] / p["decode_tok_s"]
    print(rows[-2:], flush=True)
    # the packaged pair, modelled: its tokens per target pass over this device's costs of a
    # 1 + k token target forward and k 0.5B-shaped draft forwards, against one target forward
    k = args.pair_k
    t_step = forward_seconds(engine.runner, ctx, 1, clock)
    t_verify = forward_seconds(engine.runner, ctx, k + 1, clock)
    t_draft = forward_seconds(engine.speculator.proposer.runner, ctx, 1, clock)
    modelled = args.pair_accepted * t_step / (t_verify + k * t_draft)
    result["spec_modelled"] = modelled
    rows.append((shape, (f"MODELLED packaged pair: {args.pair_accepted} tokens per pass at "
                         f"k = {k} over forwards measured here (target 1 token "
                         f"{t_step * 1e3:.2f} ms, {k + 1} tokens {t_verify * 1e3:.2f} ms, "
                         f"0.5B draft 1 token {t_draft * 1e3:.2f} ms): {modelled:.2f}x plain"),
                 1, None, None, None))
    print(rows[-1], flush=True)
    del engine

    section("tensor parallelism")
    tensor_parallel(device, args, clock, rows, result)
    section("done")

    def f(x):
        return "" if x is None else f"{x:.1f}"

    table = "\n".join(
        ["| model shape | case | batch | decode tok/s | roofline tok/s | end-to-end tok/s |",
         "|---|---|---|---|---|---|"]
        + [f"| {s} | {c} | {b} | {f(d)} | {f(r_)} | {f(e)} |" for s, c, b, d, r_, e in rows])
    cb = result["hf_cb"]
    line = (f"RESULT b1_roofline_fraction={result['ours_b1'] / result['roof_b1']:.2f} "
            f"b1_vs_hf_compiled={result['ours_b1'] / result['hf_compiled_b1']:.2f} "
            f"b{cb_batch}_vs_hf_cb="
            f"{'n/a' if cb is None else format(result[f'ours_e2e_b{cb_batch}'] / cb, '.2f')} "
            f"spec_ideal_fraction={result['spec_ideal']:.2f} "
            f"spec_off_ratio={result['spec_off']:.2f} "
            f"spec_b1_vs_plain_modelled={result['spec_modelled']:.2f}")
    if "tp2_b1" in result and "tp1_b1" in result:  # reported: TP buys memory, not speed here
        line += f" tp2_vs_tp1_b1={result['tp2_b1'] / result['tp1_b1']:.2f}"
    if "split512_b1" in result:  # not a target: decides attention_kv_split's default
        line += (f" split_kv_b1_long={result['split512_b1'] / result['split0_b1']:.2f}"
                 f" split_kv_b8_long={result['split512_b8'] / result['split0_b8']:.2f}")
    if profile is not None:
        table += (f"\n\n## Batch 1, qwen2.5-coder-1.5b shape, {profile['mode']}: where a "
                  "decode step's time goes (torch.profiler)\n\n" + profile_table(profile))
    print(table)
    print(line)
    details = [f"device: {name}, {versions()}, copy bandwidth {bw / 1e9:.0f} GB/s",
               f"prompt {args.prompt_len} random tokens, {args.new_tokens} new tokens, greedy, "
               f"bf16, random-init weights with the shapes of bench/model_shapes/"
               + (" (SMOKE: tiny shapes, not a measurement)" if args.smoke else "")]
    details += [f"engine memory beyond weights and KV pool ({case} graphs): "
                f"{value / 2**30:.2f} GiB" for case, value in extra.items()]
    if not args.smoke or args.out != parser.get_default("out"):
        write_results(args.out, "GPU: our engine vs transformers, roofline, speculation",
                      torch.get_num_threads(), details, table, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
