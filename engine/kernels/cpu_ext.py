"""Our C++ CPU kernels (engine/kernels/csrc/), compiled once per machine with torch's
extension builder into ~/.cache/specserve/kernels and loaded from there in well under a second.

A kernel needs the CPU features its source is written for; where they are missing, or nothing
compiles (no compiler), `load` returns the reason as a string and callers use torch's own ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

log = logging.getLogger("specserve.engine")

SOURCES = Path(__file__).with_name("csrc")
KERNEL_CACHE = Path.home() / ".cache" / "specserve" / "kernels"
AVX512 = ("avx512f", "avx512dq", "avx512bw", "avx512vl", "f16c", "fma")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def load(source: str, flags: tuple[str, ...] = AVX512, cflags: tuple[str, ...] = ()):
    """The compiled module of csrc/`source`, or why there is none (a str); `cflags`: more
    compiler options."""
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    from torch.utils.cpp_extension import load as build

    path = SOURCES / source
    text = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(text + repr((flags, cflags)).encode()).hexdigest()[:12]
    name = f"specserve_{path.stem}_{digest}"
    where = KERNEL_CACHE / name
    where.mkdir(parents=True, exist_ok=True)
    if not any(where.glob("*.so")):
        log.info("compiling the CPU kernel %s into %s (once per machine)", source, where)
    try:
        return build(name=name, sources=[str(path)],
                     extra_cflags=["-O3", "-fopenmp"]  # at::parallel_for is OpenMP inline
                     + [f"-m{f.replace('_', '')}" for f in flags] + list(cflags),
                     extra_ldflags=["-fopenmp"],  # libgomp.so.1: the one torch has loaded
                     build_directory=str(where), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: say so, use torch's
        return f"it did not compile ({type(exc).__name__}: {str(exc)[-300:]})"
