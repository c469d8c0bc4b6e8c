"""Load a transformers decoder-only causal LM and its tokenizer. Must not touch the engine.

A model is named by a recipe name (converted under the model cache by
`specserve models fetch NAME`), a local folder, or a Hugging Face hub id; a GGUF file inside
a folder or hub repo can be named with `gguf_file`.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def resolve_model_path(name: str, cache_dir: str | None = None) -> str:
    """A recipe name -> its converted folder; a local folder or hub id is returned unchanged."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    if name in recipes.RECIPES:
        folder = recipes.model_dir(name, cache_dir)
        if not recipes.is_fetched(name, cache_dir):
            raise FileNotFoundError(
                f"model {name!r} is not fetched yet: run `specserve models fetch {name}` "
                f"(it will be converted into {folder})")
        return str(folder)
    return name  # a hub id; transformers resolves (and, offline, reports) it


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "auto",
               gguf_file: str | None = None, tokenizer: str | None = None,
               cache_dir: str | None = None):
    """Returns (model, tokenizer), the model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name, cache_dir)
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **extra)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: only decoder-only causal language models are supported")
    tok_path = resolve_model_path(tokenizer, cache_dir) if tokenizer else path
    tok = AutoTokenizer.from_pretrained(tok_path, **({} if tokenizer else extra))
    return model.to(torch_device).eval(), tok


def model_label(name: str) -> str:
    """A short name for logs and the API (`Qwen/X` stays, a folder becomes its base name)."""
    return Path(name).name if os.path.isdir(os.path.expanduser(name)) else name
