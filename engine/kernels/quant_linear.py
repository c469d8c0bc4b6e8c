"""Weight-only quantized linear layers: int4 group-wise and int8 per output channel.

Must not touch the engine. A layer is built from integer codes and their scales and offsets;
where they come from (a GGUF file's own 4-bit blocks, or round-to-nearest from float weights)
is engine/models/quantize.py's business.

- `Int4Linear`: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], q in 0..15, groups of
  `group_size` (32: a GGUF Q4_0/Q4_1/Q4_K sub-block) along the input features. Runs torch's
  int4 weight-only kernels (`_weight_int4pack_mm_for_cpu` on the CPU, `_weight_int4pack_mm`
  on CUDA, the kernel gpt-fast and torchao use), which take the group's scale and a "zero"
  with w = (q - 8) * scale + zero, so zero = offset + 8 * scale. The kernel wants scale and
  zero in the activations' dtype, and in bf16 forms each weight as bf16(bf16((q - 8) * scale)
  + zero): with scale and zero rounded to bf16, a weight moves by a few bf16 roundings, about
  (16 * scale + |zero| + |w|) * 2^-9 (|q - 8| <= 8; zero is the group's value at q = 8; at
  most 1/18 of a quantization step on random normal groups), two to three times what rounding
  the de-quantized weight itself to bf16 moves it (|w| * 2^-9: the bf16 reference path). The
  codes are the file's own. In fp32 the scales are exact.
- `Int8Linear`: w[n, k] = q[n, k] * scale[n], q in -127..127 (`_weight_int8pack_mm`).

Both kernels give a row the same bits whatever the other rows of the call (measured at
start-up with the rest of the batch-invariance rule, engine/kernels/batch_invariant.py).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # a GGUF 4-bit (sub-)block; the CPU kernel accepts 32, 64, 128 and 256


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8, even index in the low nibble (the stored form)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4_rtn(weight: torch.Tensor, group_size: int = GROUP_SIZE, chunk: int = 8192):
    """Round-to-nearest asymmetric int4 per group (GGUF Q4_1's form): returns (codes [N, K]
    uint8, scale [N, G] fp32, offset [N, G] fp32). For weights that have no 4-bit source.
    Works through `chunk` rows at a time (a vocabulary projection in fp32 would be a GB)."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // group_size)
    offset = torch.empty(n, k // group_size)
    for start in range(0, n, chunk):
        w = weight[start:start + chunk].detach().to(torch.float32, copy=True)
        w = w.reshape(-1, k // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        step = (hi - lo) / 15
        safe = torch.where(step > 0, step, torch.ones_like(step))
        w.sub_(lo[..., None]).div_(safe[..., None]).round_().clamp_(0, 15)
        codes[start:start + chunk] = w.reshape(-1, k).to(torch.uint8)
        scale[start:start + chunk], offset[start:start + chunk] = step, lo
    return codes, scale, offset


def quantize_int8_rtn(weight: torch.Tensor):
    """Symmetric int8 per output channel: (codes [N, K] int8, scale [N] fp32)."""
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8), scale


def _inner_k_tiles(in_features: int) -> int:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs in_features divisible by 32, got {in_features}")


class Int4Linear(torch.nn.Module):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str,
                 group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        n, k = codes.shape
        if k % group_size or scale.shape != (n, k // group_size) or offset.shape != scale.shape:
            raise ValueError(f"int4 linear: codes {tuple(codes.shape)} do not match groups of "
                             f"{group_size} with scales {tuple(scale.shape)}")
        device = torch.device(device)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        # the kernel's scale/zero pairs, [K/G, N, 2], in the activations' dtype
        zero = offset.double() + 8 * scale.double()
        pairs = torch.stack([scale.double().t(), zero.t()], dim=-1).to(dtype).contiguous()
        if device.type == "cuda":
            if dtype != torch.bfloat16:
                raise ValueError("int4 linears on CUDA run in bfloat16")
            packed = (codes[:, 0::2].to(torch.uint8) << 4) | codes[:, 1::2].to(torch.uint8)
            weight = torch.ops.aten._convert_weight_to_int4pack(packed.to(device),
                                                                _inner_k_tiles(k))
        else:
            if dtype not in (torch.bfloat16, torch.float32, torch.float16):
                raise ValueError(f"int4 linears do not run in {dtype}")
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32),
                                                                        1)
        self.register_buffer("weight_packed", weight)
        self.register_buffer("scale_zero", pairs.to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype)
                             .to(device))

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.weight_packed, self.group_size,
                                                      self.scale_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_packed,
                                                          self.group_size, self.scale_zero)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        y = self._mm(x)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, [N, K] fp32 (for tests and reports)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype,
                        device=self.scale_zero.device)
        return self._mm(eye).float().t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class Int8Linear(torch.nn.Module):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_int8", codes.to(torch.int8).to(device).contiguous())
        self.register_buffer("scale", scale.to(dtype).to(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype)
                             .to(device))
        if torch.device(device).type != "cpu":  # torch's kernel exists on some devices only
            try:
                self.matmul(torch.zeros(1, self.in_features, dtype=dtype, device=device))
            except (RuntimeError, NotImplementedError) as exc:
                raise ValueError(f"int8 linears do not run on {device} in this torch "
                                 f"({type(exc).__name__}); use quantization int4 or none"
                                 ) from exc

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scale)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


QUANTIZED_LINEARS = (Int4Linear, Int8Linear)


def stand_in(module: Int4Linear | Int8Linear, out_features: int, dtype: torch.dtype,
             seed: int = 0) -> Int4Linear | Int8Linear:
    """A layer of the same kind, input size, dtype and device with `out_features` outputs of
    random codes: what the batch-invariance check measures instead of a large layer (a
    vocabulary projection), since the kernel's reduction does not depend on the values."""
    gen = torch.Generator().manual_seed(seed)
    k = module.in_features
    device = next(module.buffers()).device
    if isinstance(module, Int4Linear):
        groups = k // module.group_size
        return Int4Linear(torch.randint(0, 16, (out_features, k), generator=gen),
                          torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3,
                          torch.rand(out_features, groups, generator=gen) * -0.15, None, dtype,
                          device, module.group_size)
    return Int8Linear(torch.randint(-127, 128, (out_features, k), generator=gen),
                      torch.rand(out_features, generator=gen) * 0.002 + 1e-4, None, dtype, device)
