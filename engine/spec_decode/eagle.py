"""EAGLE-3 style draft head: one decoder layer that drafts from the target's own hidden states.

Must not schedule, verify or run the target: it is a module, its file format and its checks.

Inputs of the head's row at position q (q >= 1): the target's hidden states at position q - 1
after a few of its layers (`HeadConfig.layers`: a low, a middle and a late one), fused by `fc`
into one hidden-size vector g, and the target's embedding of the token at q. The row predicts
the token at q + 1. One decoder layer (attention over the head's own K/V of earlier rows, then
an MLP) turns `cat(norm(embedding), norm(g))` into h (residual on g); `lm_head(norm(h))`
scores a draft vocabulary (`vocab`: the target ids of its rows, most frequent tokens first).
Chained drafting feeds h forward as the next row's g: for a sequence of n tokens, the row at
n - 1 drafts token n; the row at n takes (its h, draft 1) and drafts token n + 1; and so on.

The file: a folder with `config.json` (HeadConfig, naming the target it was trained for) and
`model.safetensors` (the head's weights; the embedding is the target's own and not stored).
A head is refused for a target of another shape, or whose embedding does not match the one it
was trained with (`check_target`): cosine similarity of a fixed sample of embedding rows, so a
quantized form of the same target passes and another model of the same shape does not.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specserve-eagle-head-1"
FINGERPRINT_ROWS = 64  # embedding rows sampled for the target check
FINGERPRINT_DIMS = 64
MIN_FINGERPRINT_COSINE = 0.9  # quantized forms of one model measure > 0.99


class HeadFileError(ValueError):
    """A head that cannot be served: missing, corrupt, or trained for another target."""


@dataclass
class HeadConfig:
    target: str  # the target's name as served (recipe, folder or hub id), for messages
    target_shape: dict  # the target's architecture numbers the head was built on
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    layers: list[int]  # the target layers whose outputs are the head's features
    vocab: list[int] = field(default_factory=list)  # target id of each draft-vocabulary row
    fingerprint: list[list[float]] = field(default_factory=list)  # sampled embedding rows
    format: str = FORMAT
    trained: dict = field(default_factory=dict)  # what the training reported

    @property
    def feature_size(self) -> int:
        return len(self.layers) * self.hidden_size


def target_shape(model: nn.Module) -> dict:
    """The whole target's numbers (a tensor-parallel rank's share keeps its whole config as
    `unsplit_config`: engine/parallel/shard.py)."""
    cfg = getattr(model, "unsplit_config", model.config).get_text_config()
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
            "num_attention_heads": cfg.num_attention_heads}


def feature_layers(num_layers: int) -> list[int]:
    """The target layers (0-based; a feature is that layer's output) a head reads: a low, a
    middle and a late one, as EAGLE-3 (the last layer's output is shaped for the target's own
    logits, so the late one is a few layers before it)."""
    last = num_layers - 1
    return [min(1, last), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)]


def _fingerprint_rows(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randperm(vocab_size, generator=g)[:FINGERPRINT_ROWS]


def fingerprint(model: nn.Module) -> list[list[float]]:
    """A fixed sample of the target's embedding rows (the first dimensions), as floats."""
    weight = model.get_input_embeddings().weight
    rows = _fingerprint_rows(weight.shape[0]).to(weight.device)
    return weight[rows, :FINGERPRINT_DIMS].float().cpu().tolist()


def head_config(model: nn.Module, name: str, vocab: list[int]) -> HeadConfig:
    """The config of a new head for `model` over the draft vocabulary `vocab`."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return HeadConfig(
        target=name, target_shape=target_shape(model), hidden_size=cfg.hidden_size,
        num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim, intermediate_size=cfg.intermediate_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(cfg, "rope_theta", None)
                         or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
                         or 10000.0),
        layers=feature_layers(cfg.num_hidden_layers), vocab=list(vocab),
        fingerprint=fingerprint(model))


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = c = config
        h, q_out, kv_out = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(c.feature_size, h, bias=False)
        self.embed_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.feature_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, q_out, bias=True)
        self.k_proj = nn.Linear(2 * h, kv_out, bias=True)
        self.v_proj = nn.Linear(2 * h, kv_out, bias=True)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(c.vocab), bias=False)
        self.register_buffer("vocab", torch.tensor(c.vocab, dtype=torch.long), persistent=False)
        self.layer_idx = 0  # the paged attention function's layer in the head's KV cache
        self.is_causal = True

    # -- the layer -------------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] at `positions` ([T] long)."""
        d = self.config.head_dim  # (float32 whatever the head's dtype)
        inv = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
        angles = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def qkv(self, embeddings: torch.Tensor, g: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d] of rows with token embeddings and features
        g ([T, H] each), rotated at `positions`."""
        c = self.config
        x = torch.cat([self.embed_norm(embeddings), self.feature_norm(g)], dim=-1)
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = self.rotary(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """h [T, H]: the layer's output from its attention ([T, heads, d]) on residual g."""
        h = g + self.o_proj(attended.flatten(1))
        x = self.mlp_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, draft vocab] scores of the next tokens after rows with outputs h."""
        return self.lm_head(self.norm(h))

    def paged(self, embeddings: torch.Tensor, g: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
        """h of rows whose K/V the active paged cache writes and reads (the serving path: the
        proposer has made the head's cache active, engine/attention/paged.py)."""
        from engine.attention.paged import paged_attention_forward

        q, k, v = self.qkv(embeddings, g, positions)
        out, _ = paged_attention_forward(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], None,
                                         scaling=self.config.head_dim ** -0.5)
        return self.finish(g, out[0])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# -- files --------------------------------------------------------------------------------------
def save_head(head: nn.Module, path: str) -> None:
    """Save a head (an EagleHead, or MedusaHeads) and its config into folder `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in head.state_dict().items()}
    tmp = os.path.join(path, WEIGHTS_FILE + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE + ".tmp"), "w") as f:
        json.dump(asdict(head.config), f)
    os.replace(os.path.join(path, CONFIG_FILE + ".tmp"), os.path.join(path, CONFIG_FILE))


def read_json(path: str, option: str) -> tuple[dict, str]:
    """(the config.json of the speculator folder `path`, its file name), or HeadFileError."""
    where = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise HeadFileError(f"invalid {option}: {path!r} is not a folder (a speculator is a "
                            f"folder with {CONFIG_FILE} and {WEIGHTS_FILE}; train one with "
                            f"`specserve speculator train`)")
    try:
        with open(where) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HeadFileError(f"invalid {option}: {where} is missing") from None
    except ValueError as exc:
        raise HeadFileError(f"invalid {option}: {where} is not a speculator config ({exc})"
                            ) from None
    if not isinstance(data, dict):
        raise HeadFileError(f"invalid {option}: {where} is not a speculator config")
    return data, where


def config_from(data: dict, where: str, option: str) -> HeadConfig:
    try:
        return HeadConfig(**data)
    except TypeError as exc:
        raise HeadFileError(f"invalid {option}: {where} is not a speculator config ({exc})"
                            ) from None


def check_target(config: HeadConfig, model: nn.Module,
                 option: str = "speculative.speculator") -> None:
    """Refuse a head trained for another target (see the module docstring)."""
    check_same_target(config.target, config.target_shape, config.fingerprint, model, option,
                      "the speculator was trained")


def check_same_target(name: str, shape_then: dict, fingerprint_then: list, model: nn.Module,
                      option: str, subject: str) -> None:
    """Refuse what was made with (`subject`: "the speculator was trained", "the traffic was
    recorded") another target than `model`: another shape or other embeddings."""
    shape = target_shape(model)
    if shape != shape_then:
        diff = {k: ((shape_then or {}).get(k), v) for k, v in shape.items()
                if (shape_then or {}).get(k) != v}
        raise HeadFileError(f"invalid {option}: {subject} for {name!r}, a target of another "
                            f"shape (then, now: {diff})")
    ours = torch.tensor(fingerprint(model))
    theirs = torch.tensor(fingerprint_then or [])
    cos = F.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item() \
        if ours.shape == theirs.shape else 0.0
    if not cos >= MIN_FINGERPRINT_COSINE:
        raise HeadFileError(f"invalid {option}: {subject} for {name!r}; the served target's "
                            f"embeddings differ (similarity {cos:.2f} < "
                            f"{MIN_FINGERPRINT_COSINE}): another model")


def load_head(path: str, model: nn.Module, dtype: torch.dtype, device: torch.device,
              option: str = "speculative.speculator") -> EagleHead:
    """The head in folder `path`, checked against the target `model`; HeadFileError naming
    `option` when it is missing, corrupt, not an EAGLE head or for another target."""
    data, where = read_json(path, option)
    if data.get("format") != FORMAT:
        raise HeadFileError(f"invalid {option}: {where} is not an EAGLE head's config (format "
                            f"{data.get('format')!r}, expected {FORMAT!r})")
    return head_from(config_from(data, where, option), path, model, dtype, device, option)


def head_from(config: HeadConfig, path: str, model: nn.Module, dtype: torch.dtype,
              device: torch.device, option: str) -> EagleHead:
    """The head of the folder `path` whose config was read, checked against `model`."""
    check_target(config, model, option)
    head = EagleHead(config)
    load_weights(head, path, option)
    return head.to(device=device, dtype=dtype).eval()


def load_weights(module: nn.Module, path: str, option: str) -> None:
    """The weights of the folder `path` into `module` (strict, finite), or HeadFileError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = os.path.join(path, WEIGHTS_FILE)
    try:
        tensors = load_file(where)
    except FileNotFoundError:
        raise HeadFileError(f"invalid {option}: {where} is missing") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise HeadFileError(f"invalid {option}: {where} is corrupt ({exc})") from None
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise HeadFileError(f"invalid {option}: {where} does not hold this config's head "
                            f"({str(exc).splitlines()[0]})") from None
    if not all(math.isfinite(float(t.float().abs().max())) for t in tensors.values()
               if t.numel()):
        raise HeadFileError(f"invalid {option}: {where} holds non-finite weights")


def initialize_from_target(head: EagleHead, model: nn.Module) -> None:
    """Start a head from the target's weights: its decoder layer a copy of the target's last
    one (the embedding half of q/k/v zero), `fc` passing the late feature through, the norms
    and the output projection (over the draft vocabulary) the target's. It does not draft well
    untrained (it reads the token the target already saw, not the next one), but training
    starts from the target's own output space instead of from noise."""
    weight = _dense_weight
    c, h = head.config, head.config.hidden_size
    layer = model.model.layers[-1]
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        head.fc.weight.zero_()
        late = len(c.layers) - 1
        head.fc.weight[:, late * h:(late + 1) * h] = torch.eye(h)
        for mine, theirs in ((head.q_proj, attn.q_proj), (head.k_proj, attn.k_proj),
                             (head.v_proj, attn.v_proj)):
            mine.weight.zero_()
            mine.weight[:, h:] = weight(theirs)
            bias = getattr(theirs, "bias", None)
            mine.bias.copy_(bias.float() if bias is not None else torch.zeros_like(mine.bias))
        head.o_proj.weight.copy_(weight(attn.o_proj))
        for mine, theirs in ((head.gate_proj, mlp.gate_proj), (head.up_proj, mlp.up_proj),
                             (head.down_proj, mlp.down_proj)):
            mine.weight.copy_(weight(theirs))
        head.feature_norm.weight.copy_(layer.input_layernorm.weight.float())
        head.mlp_norm.weight.copy_(layer.post_attention_layernorm.weight.float())
        head.norm.weight.copy_(model.model.norm.weight.float())
        copy_output_rows(head.lm_head, model, head.vocab)


def copy_output_rows(linear: nn.Linear, model: nn.Module, vocab: torch.Tensor) -> None:
    """`linear`'s weight := the target's output projection rows of `vocab` (its draft
    vocabulary), dequantized where the target is int4."""
    from engine.kernels.quant_linear import Int4Linear

    out = model.get_output_embeddings()
    with torch.no_grad():
        if isinstance(out, Int4Linear):
            rows = vocab.to(next(model.parameters()).device)
            linear.weight.copy_(out.select_rows(rows).dequantized())
        else:
            linear.weight.copy_(_dense_weight(out)[vocab.cpu()])


def _dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear's weight as float32 [out, in], whatever form it is served in."""
    from engine.kernels.quant_linear import Int4Linear

    if isinstance(linear, Int4Linear):
        return linear.dequantized()
    w = getattr(linear, "weight", None)
    if w is None or w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return linear(torch.eye(linear.in_features, dtype=torch.float32)).t()
    return w.detach().float()
