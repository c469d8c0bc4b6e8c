"""Splitting the target over tensor-parallel ranks: which rows and columns of each linear layer
a rank keeps, and what the engine refuses to split. Must not run a forward or talk to other
ranks (engine/parallel/group.py does).

The split is Megatron's, on our lean forward (engine/models/lean_forward.py), not transformers'
DTensor plans: the paged attention, the batch-invariant linears and our int4 kernels keep
running on plain local tensors, and the only collective is the sum after each row-parallel
layer (`TPGroup.reduce`), whose order we fix.
- column-parallel (a rank keeps a slice of the OUTPUT features): q_proj (its query heads),
  k_proj and v_proj (its KV heads), gate_proj and up_proj (its share of the MLP);
- row-parallel (a slice of the INPUT features, partial sums added across ranks): o_proj and
  down_proj; a bias of theirs stays on rank 0 only, so it is added once.
KV heads: with at least N of them, each rank keeps KV / N; with fewer, N must be a multiple of
them and each KV head is REPLICATED on N / KV ranks, the ones whose query heads read it (each
rank then keeps one KV head: its KV cache holds one head, as vLLM does).
Embeddings, norms and the vocabulary projection stay whole on every rank (the projection runs
on rank 0 only: it samples).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from engine.kernels.quant_linear import GROUP_SIZE
from engine.models import lean_forward

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class ShardShape:
    """What one rank of N keeps of a model's attention and MLP."""

    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank (1 when replicated)
    kv_replicas: int  # ranks holding each KV head (1: none replicated)
    head_dim: int
    intermediate: int  # MLP features per rank


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shard_shape(config, size: int) -> ShardShape:
    """The per-rank shape of a model config split over `size` ranks; a ValueError naming
    tensor_parallel_size when it does not split."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    inter = cfg.intermediate_size
    where = f"invalid engine config tensor_parallel_size: {size}"
    if heads % size:
        raise ValueError(f"{where} does not divide the model's {heads} attention heads")
    if kv % size and size % kv:
        raise ValueError(f"{where}: the model's {kv} KV heads must be a multiple of it or "
                         f"divide it (then each KV head is replicated on {size} / {kv} ranks)")
    if inter % size:
        raise ValueError(f"{where} does not divide the model's MLP size {inter}")
    if kv >= size:
        return ShardShape(heads // size, kv // size, 1, head_dim, inter // size)
    return ShardShape(heads // size, 1, size // kv, head_dim, inter // size)


def check_tensor_parallel(model_config, size: int, device: torch.device,
                          quantization: str = "none", model_class: str | None = None) -> None:
    """Refuse at start-up what cannot run split over `size` ranks (a ValueError naming the
    setting): heads or MLP that do not divide, more ranks than devices, a model without the
    lean forward, quantized layers whose split does not fall on their groups."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"invalid engine config tensor_parallel_size: {size!r}, must be >= 1")
    if size == 1:
        return
    where = f"invalid engine config tensor_parallel_size: {size}"
    have = devices(device) - (device.index or 0)  # ranks take cuda:index, index + 1, ...
    if size > have:
        kind = (f"CUDA devices from {device}" if device.type == "cuda" else "CPU cores")
        raise ValueError(f"{where} is more than the {have} {kind} this machine has (one rank "
                         f"per device)")
    if model_class is not None and model_class not in lean_forward.SUPPORTED:
        raise ValueError(f"{where}: tensor parallelism runs Qwen2 and Llama models (the lean "
                         f"forward), not {model_class}")
    shape = shard_shape(model_config, size)
    if quantization in ("int4", "int8", "auto"):
        cfg = text_config(model_config)
        for name, full, split in (("o_proj", shape.heads * size * shape.head_dim,
                                   shape.heads * shape.head_dim),
                                  ("down_proj", cfg.intermediate_size, shape.intermediate)):
            if full % GROUP_SIZE == 0 and split % GROUP_SIZE:
                raise ValueError(
                    f"{where}: quantization {quantization} cannot split {name}: its {full} "
                    f"input features in {size} shares of {split} are not the multiples of "
                    f"{GROUP_SIZE} a quantized layer needs (use another tensor_parallel_size "
                    f"or quantization none)")


def devices(device: torch.device) -> int:
    """Ranks this machine can hold: its CUDA devices, or its CPU cores."""
    if device.type == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r (counting from the configured device's index) or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _head_rows(first_head: int, num_heads: int, head_dim: int) -> torch.Tensor:
    return torch.arange(first_head * head_dim, (first_head + num_heads) * head_dim)


def shard_rows(shape: ShardShape, rank: int) -> dict[str, torch.Tensor]:
    """Per column-parallel layer, the output rows rank `rank` keeps."""
    q_first = rank * shape.heads
    kv_first = rank * shape.kv_heads if shape.kv_replicas == 1 else rank // shape.kv_replicas
    kv = _head_rows(kv_first, shape.kv_heads, shape.head_dim)
    mlp = torch.arange(rank * shape.intermediate, (rank + 1) * shape.intermediate)
    return {"q_proj": _head_rows(q_first, shape.heads, shape.head_dim), "k_proj": kv,
            "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}


def shard_cols(shape: ShardShape, rank: int) -> dict[str, tuple[int, int]]:
    """Per row-parallel layer, the input columns [start, end) rank `rank` keeps."""
    attn = shape.heads * shape.head_dim
    return {"o_proj": (rank * attn, (rank + 1) * attn),
            "down_proj": (rank * shape.intermediate, (rank + 1) * shape.intermediate)}


def _sliced(linear: torch.nn.Linear, rows: torch.Tensor | None,
            cols: tuple[int, int] | None, keep_bias: bool) -> torch.nn.Linear:
    """A new Linear of `linear`'s rows (output features) or columns (input features); it
    remembers the slice (`tp_rows` / `tp_cols`) so quantization can slice stored codes alike."""
    w = linear.weight.detach()
    bias = linear.bias.detach() if linear.bias is not None else None
    if rows is not None:
        w = w[rows.to(w.device)]
        bias = bias[rows.to(w.device)] if bias is not None else None
    else:
        w = w[:, cols[0]:cols[1]]
        bias = bias if keep_bias else (torch.zeros_like(bias) if bias is not None else None)
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device,
                          dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if bias is not None:
            new.bias.copy_(bias)
    new.requires_grad_(False)
    if rows is not None:
        new.tp_rows = rows.cpu()
    else:
        new.tp_cols = cols
    return new


def shard_model(model: torch.nn.Module, rank: int, size: int,
                owned: bool = True) -> torch.nn.Module:
    """`model` with only rank `rank`'s share of its attention and MLP linears (a copy unless
    `owned`); its config then describes the shard (heads, KV heads, MLP size per rank), so the
    KV cache, the memory plan and the batch-invariance check see what the rank computes; the
    whole model's is `model.unsplit_config`. `model.tensor_parallel` = (rank, size)."""
    if not owned:
        model = copy.deepcopy(model)
    shape = shard_shape(model.config, size)
    rows, cols = shard_rows(shape, rank), shard_cols(shape, rank)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in COLUMN + ROW:
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                if type(linear) is not torch.nn.Linear:
                    raise ValueError(f"tensor parallelism splits unquantized linear layers "
                                     f"before quantizing them; {name} is a "
                                     f"{type(linear).__name__}")
                setattr(parent, name, _sliced(linear, rows.get(name), cols.get(name),
                                              keep_bias=rank == 0))
    cfg = copy.deepcopy(model.config)
    text = text_config(cfg)
    text.num_attention_heads, text.num_key_value_heads = shape.heads, shape.kv_heads
    text.head_dim, text.intermediate_size = shape.head_dim, shape.intermediate
    model.unsplit_config, model.config = model.config, cfg
    model.tensor_parallel = (rank, size)
    return model
