"""The results file every bench script writes: title, what ran where and when, table, RESULT."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return transformers.__version__


def cpu_model() -> str:
    """The CPU's model name (results differ by CPU: matmul kernels, and so what batch
    invariance costs, are chosen per CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_vendor() -> str:
    """"intel", "amd" or "other": where a bench's results differ by CPU maker (its kernels'
    costs do), each keeps its own results file."""
    name = cpu_model().lower()
    return "intel" if "intel" in name else "amd" if "amd" in name else "other"


def write_results(out: str | Path, title: str, threads: int, details: list[str], table: str,
                  result: str) -> None:
    """details: bench-specific lines (models, dtypes, workload) after date, machine, command."""
    command = " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    meta = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"machine: {platform.machine()} ({cpu_model()}), {os.cpu_count()} CPUs, {threads} torch threads, "
            f"torch {torch.__version__}, transformers {_transformers_version()}",
            f"command: `{command}`", *details]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\n" + "".join(f"- {line}\n" for line in meta)
                   + f"\n{table}\n\n`{result}`\n")
