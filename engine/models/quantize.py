"""Quantized weights for a loaded model: GGUF 4-bit blocks kept as they are, the rest
re-quantized. Must not touch the engine.

Modes (`engine.quantization`, `speculative.draft_quantization`):
- none: the model as loaded (the recipes' de-quantized bf16/fp32 weights: the reference).
- int4: every linear layer int4 group-wise (engine/kernels/quant_linear.py). A layer whose
  GGUF source is Q4_0, Q4_1 or Q4_K keeps the file's own codes, scales and offsets (a Q4_K
  sub-block of 32 is d*sc*q - dmin*m: an affine group-32 quantization, so nothing is
  re-quantized); any other layer is quantized round-to-nearest from the loaded weights.
- int8: every linear layer int8 per output channel, from the loaded weights.
- auto: int4 on the CPU for a model with a GGUF source (its 4-bit blocks kept, its 5-8-bit
  layers re-quantized to int4: the int8 kernel measured 1.2x slower at one row and 1.6x at
  five than int4 on the packaged 1.5B model); `none` on CUDA and for models without a GGUF
  source.
Embeddings stay in the model's dtype (a lookup reads one row per token).

The GGUF form is converted once (`specserve models fetch`) into `quantized-gguf.safetensors`
in the model's folder: per linear layer its 4-bit codes (two per byte), scales and offsets
(fp32), and every linear's GGUF type; loading it takes seconds.
"""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from engine.kernels.quant_linear import (GROUP_SIZE, Int4Linear, Int8Linear, pack_nibbles,
                                         quantize_int4_rtn, quantize_int8_rtn, unpack_nibbles)

log = logging.getLogger("specserve.engine")

MODES = ("none", "int8", "int4", "auto")
STORED_FILE = "quantized-gguf.safetensors"
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


# -- GGUF blocks -> (codes, scale, offset) --------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _q4_0(blocks: np.ndarray):  # [N, nb, 18]: d f16, 16 bytes of codes (w = d * (q - 8))
    d = _f16(blocks[..., 0:2])
    qs = blocks[..., 2:18]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # values 0..15 low, 16..31 high
    return q, d, -8 * d


def _q4_1(blocks: np.ndarray):  # [N, nb, 20]: d f16, m f16, 16 bytes (w = d * q + m)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    qs = blocks[..., 4:20]
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1), d, m


def _q4_k(blocks: np.ndarray):
    """[N, nb, 144] super-blocks of 256: d f16, dmin f16, 12 bytes of eight 6-bit scales and
    mins, 128 bytes of codes; sub-block j (32 values): w = d * sc[j] * q - dmin * m[j]."""
    n, nb = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.empty((n, nb, 8), np.uint8)
    mn = np.empty((n, nb, 8), np.uint8)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:144].reshape(n, nb, 4, 32)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, nb, 8, 32)
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * mn.astype(np.float32))
    return q.reshape(n, nb * 8, 32), scale.reshape(n, nb * 8), offset.reshape(n, nb * 8)


_DECODERS = {"Q4_0": (_q4_0, 18, 32), "Q4_1": (_q4_1, 20, 32), "Q4_K": (_q4_k, 144, 256)}


def gguf_int4_groups(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF reader tensor of a 4-bit type -> codes [N, K] uint8, scale and offset [N, K/32]
    fp32, with w = codes * scale + offset per group of 32."""
    decode, nbytes, per_block = _DECODERS[tensor.tensor_type.name]
    n, k = int(tensor.shape[1]), int(tensor.shape[0])
    blocks = np.asarray(tensor.data).reshape(n, k // per_block, nbytes)
    q, scale, offset = decode(blocks)
    return (np.ascontiguousarray(q.reshape(n, k)), scale.reshape(n, k // GROUP_SIZE),
            offset.reshape(n, k // GROUP_SIZE))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores llama's q/k rows interleaved for its rotary form; transformers'
    GGUF loader puts them back (the same row permutation, applied per row here)."""
    dim = a.shape[0] // heads // 2
    return a.reshape(heads, dim, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)


def convert_gguf(gguf_path: str | Path, dest_dir: str | Path) -> Path:
    """Write the stored GGUF form (see the module docstring) next to a converted model."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    heads = kv_heads = None
    if arch == "llama":
        heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
        kv_heads = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    names = {t.name for t in reader.tensors}
    tensors, types = {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        types[name] = t.tensor_type.name
        if t.tensor_type.name not in INT4_TYPES:
            continue
        q, scale, offset = gguf_int4_groups(t)
        if heads and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            h = heads if "attn_q" in t.name else kv_heads
            q, scale, offset = (_unpermute_rows(a, h) for a in (q, scale, offset))
        tensors[f"{name}.codes"] = pack_nibbles(torch.from_numpy(np.ascontiguousarray(q)))
        tensors[f"{name}.scale"] = torch.from_numpy(np.ascontiguousarray(scale))
        tensors[f"{name}.offset"] = torch.from_numpy(np.ascontiguousarray(offset))
    if "output.weight" not in names and "token_embd.weight" in names:  # tied head
        types["lm_head"] = next(t.tensor_type.name for t in reader.tensors
                                if t.name == "token_embd.weight")
    out = Path(dest_dir) / STORED_FILE
    tmp = out.with_suffix(".partial")
    save_file(tensors, str(tmp), metadata={"gguf_types": json.dumps(types),
                                           "group_size": str(GROUP_SIZE)})
    tmp.replace(out)
    return out


class StoredGGUF:
    """The stored GGUF form of one model folder."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt")
        self.types: dict[str, str] = json.loads(self._file.metadata()["gguf_types"])

    def int4_groups(self, name: str):
        if self.types.get(name) not in INT4_TYPES:
            return None
        codes = unpack_nibbles(self._file.get_tensor(f"{name}.codes"))
        return codes, self._file.get_tensor(f"{name}.scale"), \
            self._file.get_tensor(f"{name}.offset")

    @classmethod
    def find(cls, folder: str | Path | None) -> "StoredGGUF | None":
        path = Path(folder) / STORED_FILE if folder else None
        return cls(path) if path is not None and path.is_file() else None


# -- applying a mode to a loaded model ------------------------------------------------------
def apply_quantization(model: torch.nn.Module, mode: str, source: str | Path | None = None,
                       owned: bool = True, what: str = "model",
                       int4_kernel: str = "auto") -> torch.nn.Module:
    """The model to run for `mode`: `model` itself, quantized in place when `owned` (the engine
    loaded it: no second copy in memory), else a quantized copy (a caller's model is never
    changed)."""
    if mode == "none":
        return model
    stored = StoredGGUF.find(source) if mode in ("int4", "auto") else None
    if mode in ("int4", "auto") and stored is None and source is not None \
            and (Path(source) / "specserve-recipe.json").is_file():
        log.warning("%s: %s has no stored GGUF form (%s); run `specserve models fetch %s "
                    "--force` to add it. Until then int4 re-quantizes the converted weights and "
                    "auto serves them unquantized", what, source, STORED_FILE, Path(source).name)
    if not owned:
        model = copy.deepcopy(model)
    quantize_model(model, mode, stored=stored, int4_kernel=int4_kernel)
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """The replaced float weights were freed into the C allocator; give the pages back to the
    OS (glibc keeps them otherwise: measured ~1 GB of RSS on the 0.5B draft)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _linears(model: torch.nn.Module):
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            yield name, module


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _slice_groups(linear: torch.nn.Module, codes: torch.Tensor, scale: torch.Tensor,
                  offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole layer's stored groups (codes [N, K], scale/offset [N, K / GROUP_SIZE]) cut to
    the share a tensor-parallel rank keeps of it (engine/parallel/shard.py records it as the
    layer's `tp_rows`, output rows, or `tp_cols`, input columns); unchanged for a whole
    layer."""
    rows = getattr(linear, "tp_rows", None)
    if rows is not None:
        return codes[rows], scale[rows], offset[rows]
    cols = getattr(linear, "tp_cols", None)
    if cols is None:
        return codes, scale, offset
    start, end = cols
    if start % GROUP_SIZE or end % GROUP_SIZE:
        raise ValueError(f"int4 groups of {GROUP_SIZE} cannot be split at input columns "
                         f"{start}:{end}")
    groups = slice(start // GROUP_SIZE, end // GROUP_SIZE)
    return codes[:, start:end], scale[:, groups], offset[:, groups]


def quantize_model(model: torch.nn.Module, mode: str, source: str | Path | None = None,
                   stored: StoredGGUF | None = None, int4_kernel: str = "auto",
                   dtype: torch.dtype | None = None) -> dict[str, int]:
    """Replace `model`'s linear layers in place as `mode` says; `source`: the model's folder
    (its stored GGUF form, if any), or the stored form already opened; `int4_kernel`: see
    Int4Linear; `dtype`: the activations' (default: the input embeddings'). Returns how many
    layers got each form."""
    if mode not in MODES:
        raise ValueError(f"invalid quantization {mode!r}; use one of {MODES}")
    if stored is None and mode in ("int4", "auto"):
        stored = StoredGGUF.find(source)
    device = next(model.parameters()).device
    if mode == "auto":
        mode = "int4" if stored is not None and device.type == "cpu" else "none"
    counts = {"int4": 0, "int4_gguf": 0, "int8": 0, "unchanged": 0}
    if mode == "none":
        return counts
    dtype = dtype or model.get_input_embeddings().weight.dtype
    for name, linear in list(_linears(model)):
        if linear.in_features % GROUP_SIZE:
            counts["unchanged"] += 1
            continue
        groups = stored.int4_groups(name) if mode == "int4" and stored is not None else None
        if groups is not None:
            groups = _slice_groups(linear, *groups)
        if groups is not None and groups[0].shape != linear.weight.shape:
            raise ValueError(f"{name}: stored GGUF codes {tuple(groups[0].shape)} do not match "
                             f"the model's weight {tuple(linear.weight.shape)}")
        if mode == "int4":
            counts["int4_gguf" if groups is not None else "int4"] += 1
            codes, scale, offset = groups if groups is not None else quantize_int4_rtn(
                linear.weight)
            new = Int4Linear(codes, scale, offset, linear.bias, dtype, device,
                             kernel=int4_kernel)
        else:
            counts["int8"] += 1
            codes, scale = quantize_int8_rtn(linear.weight)
            new = Int8Linear(codes, scale, linear.bias, dtype, device)
        _set_module(model, name, new)
    log.info("quantized linears (%s): %s", mode, counts)
    return counts
