"""Load a transformers decoder-only causal LM and its tokenizer. Must not touch the engine.

A model is named by a recipe name (converted under the model cache by
`specserve models fetch NAME`), a local folder, or a Hugging Face hub id; a GGUF file inside
a folder or hub repo can be named with `gguf_file`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from engine.models import recipes

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"invalid dtype {name!r}; use one of {sorted(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message says in one line what was tried and what to
    do."""


def resolve_model_path(name: str, cache_dir: str | None = None) -> str:
    """A recipe name -> its converted folder; a local folder or hub id is returned unchanged."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name in recipes.RECIPES:
        folder = recipes.model_dir(name, cache_dir)
        if not recipes.is_fetched(name, cache_dir):
            raise ModelLoadError(
                f"model {name!r} is not fetched yet: run `specserve models fetch {name}` "
                f"(it will be converted into {folder})")
        return str(folder)
    return name  # a hub id; transformers resolves (and, offline, reports) it


def _hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be asked (offline mode, no route to it), or None. With a
    proxy configured the hub library is left to find out."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError as exc:
        return f"{endpoint.hostname} is unreachable: {exc}"
    return None


def _from_pretrained(loader, name: str, path: str, what: str, **kw):
    """`loader.from_pretrained(path)`, and for a name that is neither a recipe nor a folder
    (a hub id): its local cache only when the hub cannot be reached (no retries for half a
    minute), a failure said in one line (ModelLoadError)."""
    offline = None if os.path.isdir(path) else _hub_unreachable()
    try:
        return loader.from_pretrained(path, **kw, **({"local_files_only": True}
                                                     if offline else {}))
    except OSError as exc:
        if os.path.isdir(path):
            raise ModelLoadError(f"{what} {name!r}: the folder {path} does not hold a loadable "
                                 f"model ({str(exc).splitlines()[0]})") from exc
        raise ModelLoadError(
            f"{what} {name!r} is not a recipe, not a local folder, and not found in the Hugging "
            f"Face cache{f' ({offline})' if offline else ' nor on the hub'}: "
            f"`specserve models list` shows the models that install here, "
            f"`specserve models fetch NAME` fetches one, or pass a folder") from exc


def load_tokenizer(name: str, gguf_file: str | None = None, tokenizer: str | None = None,
                   cache_dir: str | None = None):
    """The tokenizer `load_model` would return for the same arguments."""
    from transformers import AutoTokenizer

    if tokenizer:
        return _from_pretrained(AutoTokenizer, tokenizer,
                                resolve_model_path(tokenizer, cache_dir), "tokenizer")
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return _from_pretrained(AutoTokenizer, name, resolve_model_path(name, cache_dir), "model",
                            **extra)


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "auto",
               gguf_file: str | None = None, tokenizer: str | None = None,
               cache_dir: str | None = None):
    """Returns (model, tokenizer), the model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name, cache_dir)
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = _from_pretrained(AutoModelForCausalLM, name, path, "model", dtype=torch_dtype,
                             **extra)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: only decoder-only causal language models are supported")
    tok = load_tokenizer(name, gguf_file, tokenizer, cache_dir)
    return model.to(torch_device).eval(), tok


def model_label(name: str) -> str:
    """A short name for logs and the API (`Qwen/X` stays, a folder becomes its base name)."""
    return Path(name).name if os.path.isdir(os.path.expanduser(name)) else name
