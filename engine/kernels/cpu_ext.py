"""Our C++ CPU kernels (engine/kernels/csrc/), compiled once per machine with torch's
extension builder into ~/.cache/specserve/kernels and loaded from there in well under a second.

A kernel needs the CPU features its source is written for; where they are missing, or nothing
compiles (no compiler), `load` returns the reason as a string and callers use torch's own ops.

Builders of one folder take turns through an OS lock (`flock`, released when its holder dies):
torch's own lock file, left behind by a process killed while it compiled (a container restarted
during its first start), would make every later start wait for it forever.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
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


# Every kernel: its source, the CPU features it is written for (each compiled in as -m<feature>,
# never -march=native: the built module runs on any CPU with these features) and more options.
KERNELS = {
    "paged_attention": ("paged_attention.cpp", AVX512, ()),
    # without contracting a product and a sum into one FMA: the ops round as torch's
    "fused_ops": ("fused_ops.cpp", AVX512, ("-ffp-contract=off",)),
    "int4_vnni": ("int4_vnni.cpp", AVX512 + ("avx512_vnni",), ()),
    "decode_layers": ("decode_layers.cpp", (), ()),
}


def load(kernel: str):
    """The compiled module of KERNELS[`kernel`], or why there is none (a str)."""
    source, flags, cflags = KERNELS[kernel]
    missing = [f for f in flags if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return _build(source, flags, cflags)


def _where(source: str, flags: tuple[str, ...], cflags: tuple[str, ...]) -> Path:
    """The build folder: named by the source, its headers, the features and options."""
    path = SOURCES / source
    text = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(text + repr((flags, cflags)).encode()).hexdigest()[:12]
    return KERNEL_CACHE / f"specserve_{path.stem}_{digest}"


@functools.cache
def _build(source: str, flags: tuple[str, ...], cflags: tuple[str, ...]):
    from torch.utils.cpp_extension import load as build

    path = SOURCES / source
    where = _where(source, flags, cflags)
    name = where.name
    where.mkdir(parents=True, exist_ok=True)
    if not any(where.glob("*.so")):
        log.info("compiling the CPU kernel %s into %s (once per machine)", source, where)
    try:
        # (read-only: a lock file another user created serves too; flock needs no write)
        turn = os.open(where / "build.flock", os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)  # (every builder of the folder holds it first, so
            (where / "lock").unlink(missing_ok=True)  # torch's lock here is a dead one's)
            return build(name=name, sources=[str(path)],
                         extra_cflags=["-O3", "-fopenmp"]  # at::parallel_for is OpenMP inline
                         + [f"-m{f.replace('_', '')}" for f in flags] + list(cflags),
                         extra_ldflags=["-fopenmp"],  # libgomp.so.1: the one torch has loaded
                         build_directory=str(where), verbose=False)
        finally:
            os.close(turn)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: say so, use torch's
        return f"it did not compile ({type(exc).__name__}: {str(exc)[-300:]})"


def compile_all() -> dict[str, str]:
    """Compiles every kernel into KERNEL_CACHE whatever this CPU has (compiling needs no
    feature; running does, and `load` checks it): the container image does this at build time.
    Returns how each went."""
    done = {}
    for kernel, spec in KERNELS.items():
        result = _build(*spec)
        # where this CPU lacks a feature the module may build and then fail to import: built
        built = any(_where(*spec).glob("*.so"))
        done[kernel] = "compiled" if built else str(result)
    return done


if __name__ == "__main__":  # python -m engine.kernels.cpu_ext: compile them all now
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = compile_all()
    for kernel, how in results.items():
        print(f"{kernel}: {how}")
    raise SystemExit(0 if set(results.values()) == {"compiled"} else 1)
