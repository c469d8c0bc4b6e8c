"""Weight-only quantized linear layers: int4 group-wise and int8 per output channel.

Must not touch the engine. A layer is built from integer codes and their scales and offsets;
where they come from (a GGUF file's own 4-bit blocks, or round-to-nearest from float weights)
is engine/models/quantize.py's business.

- `Int4Linear`: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], q in 0..15, groups of
  `group_size` (32: a GGUF Q4_0/Q4_1/Q4_K sub-block) along the input features. The codes are
  the file's own. Two kernels (`kernel`):
  - "vnni" (the CPU default where the CPU has AVX-512 VNNI): our own kernel
    (engine/kernels/csrc/int4_vnni.cpp, compiled once per machine: engine/kernels/cpu_ext.py),
    the form llama.cpp runs its Q4 files in. Scales and offsets are stored as Q4_K stores
    them, 8-bit multiples of an fp16 unit per run of 8 groups (`pack_vnni`'s compact form:
    exact for a Q4_K layer and for `quantize_int4_rtn`'s), otherwise as fp16: a weight then
    moves by at most (15 * |scale| + |offset|) * 2^-11, against |w| * 2^-9 for the bf16
    reference. The ACTIVATIONS are quantized per row and group of 32 to int8
    (a = round(x * 127 / max|x|): each product carries an error of at most 1/254 of its
    group's largest |x|, as with llama.cpp's Q8 activations) and multiplied with `vpdpbusd`;
    the group's offset term uses the exact fp32 sum of x. Measured on random normal data:
    0.4-0.6% relative error per output against the fp32 product with the same weights. On
    the 1.5B model's linears (2 threads) it takes 0.7x the time of torch's kernel for one
    row and 0.4x for five (a verification step).
  - "torch": torch's int4 weight-only kernels (`_weight_int4pack_mm_for_cpu` on the CPU,
    `_weight_int4pack_mm` on CUDA, the kernel gpt-fast and torchao use; always on CUDA),
    which keep the activations as they are and take the group's scale and a "zero" with
    w = (q - 8) * scale + zero, so zero = offset + 8 * scale. The kernel wants scale and zero
    in the activations' dtype, and in bf16 forms each weight as bf16(bf16((q - 8) * scale) +
    zero): with scale and zero rounded to bf16, a weight moves by a few bf16 roundings, about
    (16 * scale + |zero| + |w|) * 2^-9 (at most 1/18 of a quantization step on random normal
    groups), two to three times what rounding the de-quantized weight itself to bf16 moves
    it. In fp32 the scales are exact.
- `Int8Linear`: w[n, k] = q[n, k] * scale[n], q in -127..127 (`_weight_int8pack_mm`).

Both kernels give a row the same bits whatever the other rows of the call (measured at
start-up with the rest of the batch-invariance rule, engine/kernels/batch_invariant.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.kernels import cpu_ext

log = logging.getLogger("specserve.engine")

GROUP_SIZE = 32  # a GGUF 4-bit (sub-)block; the CPU kernel accepts 32, 64, 128 and 256
VNNI_BLOCK = 16  # output rows the VNNI kernel computes together


@functools.cache
def vnni_kernel():
    """The compiled VNNI kernel (engine/kernels/csrc/int4_vnni.cpp), or why there is none."""
    return cpu_ext.load("int4_vnni")


VNNI_BUFFERS = ("codes_vnni", "groups_vnni", "units_vnni")
RUN = 8  # groups per unit of the VNNI kernel's compact scales (256 inputs: Q4_K's super-block)


def pack_vnni(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              compact: bool = True):
    """[N, K] codes, [N, G] scale and offset -> the VNNI kernel's layout (see its source):
    (codes [N/16, G, 256] uint8, groups, units). The compact form where every run of RUN groups
    of a row has its scales as exact multiples 0..255 of one fp16 unit and its offsets as exact
    multiples -127..127 of another (a GGUF Q4_K layer: d and dmin; our round-to-nearest
    layers): groups [N/16, G, 32] uint8, units [N/16, ceil(G / RUN), 32] fp16. Otherwise
    the plain form (also where `compact` is False): groups [N/16, G, 32] fp16 (the values
    rounded to fp16), units empty."""
    n, k = codes.shape
    g, nb = k // GROUP_SIZE, n // VNNI_BLOCK
    c = codes.to(torch.uint8).reshape(nb, VNNI_BLOCK, g, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(nb, g, 256).contiguous()

    def blocked(t):  # [N, X] -> [N/16, X, 16]
        return t.reshape(nb, VNNI_BLOCK, -1).transpose(1, 2)

    scales = _multiples(scale.float(), 255, False) if compact else None
    offsets = _multiples(offset.float(), 127, True) if scales is not None else None
    if scales is None or offsets is None:
        both = torch.cat([blocked(scale.half()), blocked(offset.half())], dim=2)
        return packed, both.contiguous(), torch.empty(0, dtype=torch.float16)
    groups = torch.cat([blocked(scales[0].to(torch.uint8)),
                        blocked(offsets[0].to(torch.int8).view(torch.uint8))], dim=2)
    units = torch.cat([blocked(scales[1]), blocked(offsets[1])], dim=2)
    return packed, groups.contiguous(), units.contiguous()


def _by_run(t: torch.Tensor, run: int = RUN) -> torch.Tensor:
    """[rows, G] -> [rows, ceil(G / run), run], the last run padded with zeros."""
    rows, g = t.shape
    out = t.new_zeros(rows, -(-g // run) * run)
    out[:, :g] = t
    return out.view(rows, -1, run)


def _per_group(t: torch.Tensor, g: int, run: int = RUN) -> torch.Tensor:
    """[rows, runs] -> [rows, g]: each run's value for each of its groups."""
    return t.repeat_interleave(run, 1)[:, :g]


def _multiples(values: torch.Tensor, limit: int, signed: bool, tries: int = 16):
    """values [N, G] fp32 -> (multiples [N, G] int32, units [N, ceil(G / RUN)] fp16) with
    values == units * multiples exactly (fp32) for every run of RUN groups of a row, the
    multiples in 0..limit (-limit..limit if signed); None where some run has none.

    A run's unit is its largest |value| over j for some j <= limit: Q4_K's (63: llama.cpp's
    quantizer gives a super-block's largest scale and min the 6-bit code 63), our
    round-to-nearest's (`limit`, or a little less where the unit is an fp16 subnormal), then,
    where at most 1% of the runs are left after `tries` values of j, every other j for those."""
    n, g = values.shape
    v = _by_run(values).view(-1, RUN)
    s = v.shape[0] // n
    top = v.abs().amax(-1)
    if not torch.isfinite(top).all() or (not signed and (v < 0).any()):
        return None  # (the plain form keeps such values as they are)
    mult = torch.zeros(n * s, RUN)
    unit = torch.zeros(n * s)
    todo = (top > 0).nonzero().flatten()  # (a run of zeros: unit 0)
    order = [63, limit, *range(limit - 1, 0, -1)]
    for i, j in enumerate(dict.fromkeys(order)):
        if not todo.numel():
            break
        if i == tries and todo.numel() > 0.01 * n * s:
            return None
        u = (top[todo] / j).half().float()
        m = torch.round(v[todo] / u[:, None])
        ok = (u > 0) & (m.abs() <= limit).all(-1) & (m * u[:, None] == v[todo]).all(-1)
        mult[todo[ok]], unit[todo[ok]] = m[ok], u[ok]
        todo = todo[~ok]
    if todo.numel():
        return None
    return mult.view(n, s * RUN)[:, :g].to(torch.int32), unit.view(n, s).half()


def unpack_vnni(packed: torch.Tensor, groups: torch.Tensor, units: torch.Tensor):
    """Inverse of `pack_vnni`: [N, K] codes, [N, G] scale and offset (fp32: the values the
    kernel computes with)."""
    nb, g, _ = packed.shape
    parts = packed.reshape(nb, g, 4, 4 * VNNI_BLOCK)
    halves = torch.stack([parts & 0xF, parts >> 4], dim=3)  # [nb, g, p, h, j * i]
    c = halves.reshape(nb, g, 4, 2, VNNI_BLOCK, 4).permute(0, 4, 1, 2, 3, 5)
    n = nb * VNNI_BLOCK

    def rows(t):  # [N/16, X, 16] -> [N, X]
        return t.transpose(1, 2).reshape(n, -1)

    if not units.numel():
        scale, offset = rows(groups[..., :VNNI_BLOCK]), rows(groups[..., VNNI_BLOCK:])
        return c.reshape(n, g * GROUP_SIZE), scale.float(), offset.float()
    su = _per_group(rows(units[..., :VNNI_BLOCK]).float(), g)
    ou = _per_group(rows(units[..., VNNI_BLOCK:]).float(), g)
    sm = rows(groups[..., :VNNI_BLOCK]).float()
    om = rows(groups[..., VNNI_BLOCK:].contiguous().view(torch.int8)).float()
    return c.reshape(n, g * GROUP_SIZE), sm * su, om * ou


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/2] uint8, even index in the low nibble (the stored form)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4_rtn(weight: torch.Tensor, group_size: int = GROUP_SIZE, chunk: int = 8192):
    """Round-to-nearest asymmetric int4 per group (GGUF Q4_1's form, with Q4_K's scales):
    returns (codes [N, K] uint8, scale [N, G] fp32, offset [N, G] fp32). For weights that have
    no 4-bit source. Within each run of RUN groups of a row, the offsets are multiples
    -127..127 of one fp16 unit (each at most its group's minimum) and the scales multiples
    0..255 of another (each at least the step that covers its group from that offset), as the
    VNNI kernel's compact form stores them; the codes round to nearest on that grid. Works
    through `chunk` rows at a time (a vocabulary projection in fp32 would be a GB)."""
    n, k = weight.shape
    g = k // group_size
    run = RUN if group_size == GROUP_SIZE else 1  # (other sizes: a unit per group)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, g)
    offset = torch.empty(n, g)

    def units(t: torch.Tensor, limit: int) -> torch.Tensor:
        # [rows, G] -> per group, the smallest fp16 unit of its run with limit * unit >= |t|
        top = _by_run(t.abs(), run).amax(-1)
        u = (top / limit).half()
        u = torch.where(u.float() * limit < top, torch.nextafter(u, torch.full_like(u, 1e4)), u)
        return _per_group(u.float(), g, run)

    for start in range(0, n, chunk):
        w = weight[start:start + chunk].detach().to(torch.float32, copy=True)
        w = w.reshape(-1, g, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        unit = units(lo, 127)
        safe = torch.where(unit > 0, unit, torch.ones_like(unit))
        low = torch.floor(lo / safe).clamp_(-127, 127) * unit
        raw = (hi - low) / 15
        unit = units(raw, 255)
        safe = torch.where(unit > 0, unit, torch.ones_like(unit))
        step = torch.ceil(raw / safe).clamp_(0, 255) * unit
        safe = torch.where(step > 0, step, torch.ones_like(step))
        w.sub_(low[..., None]).div_(safe[..., None]).round_().clamp_(0, 15)
        codes[start:start + chunk] = w.reshape(-1, k).to(torch.uint8)
        scale[start:start + chunk], offset[start:start + chunk] = step, low
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
                 group_size: int = GROUP_SIZE, kernel: str = "auto") -> None:
        super().__init__()
        n, k = codes.shape
        if k % group_size or scale.shape != (n, k // group_size) or offset.shape != scale.shape:
            raise ValueError(f"int4 linear: codes {tuple(codes.shape)} do not match groups of "
                             f"{group_size} with scales {tuple(scale.shape)}")
        if kernel not in ("auto", "vnni", "torch"):
            raise ValueError(f"invalid int4 kernel {kernel!r}; use auto, vnni or torch")
        device = torch.device(device)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        self.kernel = self._choose(kernel, device, dtype)
        if self.kernel == "vnni":
            for name, t in zip(VNNI_BUFFERS, pack_vnni(codes, scale, offset)):
                self.register_buffer(name, t)
            self.register_buffer("bias", None if bias is None else bias.detach().float())
            return
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

    def _choose(self, kernel: str, device: torch.device, dtype: torch.dtype) -> str:
        fits = (device.type == "cpu" and self.group_size == GROUP_SIZE
                and self.out_features % VNNI_BLOCK == 0
                and dtype in (torch.bfloat16, torch.float32))
        if kernel == "torch" or (kernel == "auto" and not fits):
            return "torch"
        if not fits:
            raise ValueError(f"the vnni int4 kernel runs on the CPU in bf16 or fp32 with groups "
                             f"of {GROUP_SIZE} and output features in multiples of "
                             f"{VNNI_BLOCK}; got {device}, {dtype}, {self.group_size}, "
                             f"{self.out_features}")
        ext = vnni_kernel()
        if isinstance(ext, str):
            if kernel == "vnni":
                raise ValueError(f"the vnni int4 kernel is not available: {ext}")
            _log_once(f"int4 linears use torch's kernel: the vnni kernel is not available "
                      f"({ext})")
            return "torch"
        return "vnni"

    def _mm(self, x: torch.Tensor) -> torch.Tensor:  # torch's kernels
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.weight_packed, self.group_size,
                                                      self.scale_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_packed,
                                                          self.group_size, self.scale_zero)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        if self.kernel == "vnni":  # the bias is added in fp32 inside the kernel
            return vnni_kernel().int4_linear(x.contiguous(), self.codes_vnni, self.groups_vnni,
                                             self.units_vnni,
                                             _NO_BIAS if self.bias is None else self.bias)
        y = self._mm(x)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, [N, K] fp32 (for tests and reports)."""
        if self.kernel == "vnni":
            codes, scale, offset = unpack_vnni(*self.vnni_buffers)
            w = codes.float().reshape(self.out_features, -1, GROUP_SIZE)
            return (w * scale[..., None] + offset[..., None]).flatten(1)
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype,
                        device=self.scale_zero.device)
        return self._mm(eye).float().t().contiguous()

    def select_rows(self, rows: torch.Tensor) -> "Int4Linear":
        """A layer of the output features `rows` ([n] long) alone, with the same codes, scales
        and kernel: each kept output gets the bits it gets here (a draft's vocabulary subset)."""
        bias = None if self.bias is None else self.bias[rows]
        if self.kernel == "vnni":
            codes, scale, offset = unpack_vnni(*self.vnni_buffers)
            # (the kernel computes in the activations' dtype: the one given here is not kept)
            return Int4Linear(codes[rows], scale[rows], offset[rows], bias,
                              torch.float32, "cpu", self.group_size, "vnni")
        codes = self._torch_codes()
        scale, zero = self.scale_zero.double().unbind(-1)  # [G, N] each
        return Int4Linear(codes[rows], scale.t()[rows], (zero - 8 * scale).t()[rows], bias,
                          self.scale_zero.dtype, self.scale_zero.device, self.group_size,
                          "torch")

    @classmethod
    def merged(cls, layers: list["Int4Linear"]) -> "Int4Linear | None":
        """One layer computing `layers` side by side (their outputs concatenated, each with the
        bits it has alone: the VNNI kernel computes each block of 16 outputs on its own), whose
        buffers the given layers then view: no weight is held twice. None where the layers do
        not merge (not all on the VNNI kernel, other input sizes, a bias on some only). Where
        some layers' scales are in the compact form and others' not, all take the plain one
        (`pack_vnni`) first: one call reads one form."""
        first = layers[0]
        if (len(layers) < 2 or any(not isinstance(m, Int4Linear) or m.kernel != "vnni"
                                   or m.in_features != first.in_features for m in layers)
                or len({m.bias is None for m in layers}) > 1):
            return None
        if len({m.compact for m in layers}) > 1:
            for m in layers:
                for name, t in zip(VNNI_BUFFERS, pack_vnni(*unpack_vnni(*m.vnni_buffers),
                                                           compact=False)):
                    m.register_buffer(name, t)
        out = cls.__new__(cls)
        torch.nn.Module.__init__(out)
        out.in_features, out.group_size, out.kernel = first.in_features, first.group_size, "vnni"
        out.out_features = sum(m.out_features for m in layers)
        for name in (*VNNI_BUFFERS, "bias"):
            parts = [getattr(m, name) for m in layers]
            out.register_buffer(name, None if parts[0] is None else torch.cat(parts))
            start = 0
            for m, part in zip(layers, parts):  # each layer views its rows of the merged one
                if part is not None:
                    m.register_buffer(name, getattr(out, name)[start:start + part.shape[0]])
                    start += part.shape[0]
        return out

    @property
    def vnni_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The VNNI kernel's codes, groups and units (`pack_vnni`)."""
        return self.codes_vnni, self.groups_vnni, self.units_vnni

    @property
    def compact(self) -> bool:
        """On the VNNI kernel with 8-bit multiples of per-run units (`pack_vnni`)."""
        return self.kernel == "vnni" and self.units_vnni.numel() > 0

    def _torch_codes(self) -> torch.Tensor:
        """[N, K] codes back from torch's CPU packing, checked by packing them again (the
        layout is torch's, not ours, and depends on the CPU): blocks of B output rows as
        [N/B, K, B/2] bytes, the low nibble of byte j holding row j of the block and the high
        one row B/2 + j; B = 64 where torch uses AVX-512, 32 where it uses AVX2."""
        n, k, packed = self.out_features, self.in_features, self.weight_packed
        if not packed.is_cuda and packed.shape == (n, k // 2):
            for rows in (64, 32):
                if n % rows:
                    continue
                v = packed.reshape(n // rows, k, rows // 2)
                codes = torch.cat([v & 0xF, v >> 4], dim=2).transpose(1, 2).reshape(n, k)
                if self._packs_to(codes):
                    return codes
        raise ValueError("rows of an int4 layer can be selected with torch's kernel on the CPU "
                         "only, for output features in multiples of its blocks (32 or 64 "
                         "rows) and a packing read as above")

    def _packs_to(self, codes: torch.Tensor) -> bool:
        again = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        return again.shape == self.weight_packed.shape and torch.equal(again,
                                                                       self.weight_packed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"kernel={self.kernel}")


_NO_BIAS = torch.empty(0)


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


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

    def select_rows(self, rows: torch.Tensor) -> "Int8Linear":
        """A layer of the output features `rows` ([n] long) alone (see Int4Linear's)."""
        return Int8Linear(self.weight_int8[rows], self.scale[rows],
                          None if self.bias is None else self.bias[rows], self.scale.dtype,
                          self.weight_int8.device)

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
    if isinstance(module, Int4Linear):  # in the module's form (`pack_vnni`: compact or plain)
        codes, scale, offset = quantize_int4_rtn(
            torch.randn(out_features, k, generator=gen) * 0.05, module.group_size)
        if not module.compact:  # scales off the compact form's grid
            scale = scale * (1 + 1e-3 * torch.rand(scale.shape, generator=gen))
        return Int4Linear(codes, scale, offset, None, dtype, device, module.group_size,
                          module.kernel)
    return Int8Linear(torch.randint(-127, 128, (out_features, k), generator=gen),
                      torch.rand(out_features, generator=gen) * 0.002 + 1e-4, None, dtype, device)
