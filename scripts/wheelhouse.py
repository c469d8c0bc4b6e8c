"""Build .wheelhouse/: the server's Python packages as CPython 3.12 manylinux x86_64 wheels, for
a GPU machine that has torch, transformers and triton but no network (`make gpu-check`
installs from it offline).

The set: the server's own requirements and everything they need (read from this environment's
installed metadata, so the versions are the ones tested here), minus what a torch +
transformers installation already brings (numpy, tokenizers, safetensors, huggingface-hub, ...)
and torch, transformers and triton themselves, which are never touched there.

    python scripts/wheelhouse.py [--out .wheelhouse]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOTS = ["fastapi", "starlette", "uvicorn", "sse-starlette", "pydantic", "pydantic-core",
         "openai", "prometheus-client", "httpx", "llguidance", "gguf", "pyyaml",
         "jsonschema"]  # the last: test modules import it, and pytest collects them all
# a torch + transformers (+ triton) installation has these; the GPU check never replaces them
PROVIDED = {"torch", "transformers", "triton", "numpy", "tokenizers", "safetensors",
            "huggingface-hub", "hf-xet", "filelock", "fsspec", "regex", "requests", "urllib3",
            "certifi", "idna", "charset-normalizer", "packaging", "typing-extensions", "jinja2",
            "markupsafe", "sympy", "mpmath", "networkx", "setuptools", "tqdm", "pyyaml"}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux1_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version, for roots and their non-optional requirements."""
    seen: dict[str, str] = {}
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in PROVIDED:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here: not needed
        seen[name] = dist.version
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            if ";" in req and "python_version" in req.split(";", 1)[1]:
                marker = req.split(";", 1)[1]
                if "< \"3.1" in marker or "<\"3.1" in marker:  # backports for old Pythons
                    continue
            todo.append(canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".wheelhouse")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    wanted = closure(ROOTS)
    for name, version in sorted(wanted.items()):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               "-d", str(out), f"{name}=={version}"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(wanted)} wheels, {size / 2**20:.1f} MiB in {out}/: "
          + ", ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
