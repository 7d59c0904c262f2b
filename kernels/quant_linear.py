"""Weight-only quantized matmuls: ``y = x W^T`` with ``W`` kept as small integers plus group scales.

Every weight-only format (GPTQ, AWQ, compressed-tensors' pack-quantized, GGUF's Q4_0 ... Q6_K) is
turned once, at load, into one canonical form, ``QuantizedWeight``:

    W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]

with ``q`` unsigned integers of ``bits`` bits, ``G`` the group size along the input features and,
for GPTQ's act-order (``desc_act``), a column permutation ``perm`` so that groups are contiguous:
the layer then computes ``x[:, perm] @ W^T``. A zero point ``z`` is ``offset = -scale * z``.

``pack`` then lays the weight out for one matmul kernel (``KERNELS``):

- ``int4pack``: PyTorch's ``aten._weight_int4pack_mm_for_cpu`` (bits <= 4, group 32/64/128/256,
  output features a multiple of 16),
  which computes ``(q - 8) * s + z`` per element, so ``z = offset + 8 * scale``;
- ``int4pack_x2``: 5- to 8-bit weights as two int4pack matmuls, ``q = 16 * hi + lo`` (exact);
- ``int8pack``: ``aten._weight_int8pack_mm`` (per-channel scales only), ``q - 128`` as int8, the
  offset added back as ``x.sum(-1) * (offset + 128 * scale)``;
- ``dequant``: dequantize to the compute dtype, then ``F.linear`` (the reference; any shape, any
  device);
- ``cpu_gemv`` (CPU, with a C++ compiler): ``fuseserve.kernels.cpu_quant_linear``, the packed integers
  widened block by block inside a C++ loop for passes of few rows;
- ``triton`` (CUDA): ``fuseserve.kernels.triton_quant_linear``, dequantizing inside a Triton GEMM.

``choose_kernel`` picks among the kernels that accept the weight on this device by measuring them on
the layer's shape (1 and 16 rows), after checking each against the reference; the choice is cached
per shape. ``FP8Weight`` is the float8 (e4m3) weight-only counterpart (dequantized per call).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

INT4PACK_GROUPS = (256, 128, 64, 32)  # group sizes aten's int4pack kernel accepts, largest first


@dataclass
class QuantizedWeight:
    """A weight-only quantized matrix in canonical form (module docstring).

    q: ``[N, K]`` uint8, values in ``[0, 2**bits)``.
    scale, offset: ``[N, K // group_size]`` float32.
    perm: ``[K]`` int64 or None: the input feature order the groups are contiguous in.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self):
        n, k = self.q.shape
        if k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide the {k} input features")
        want = (n, k // self.group_size)
        if tuple(self.scale.shape) != want or tuple(self.offset.shape) != want:
            raise ValueError(
                f"scales {tuple(self.scale.shape)} / offsets {tuple(self.offset.shape)} do not match "
                f"a [{n}, {k}] weight in groups of {self.group_size} (want {want})"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output and input features."""
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``, columns in ``perm`` order (computed in fp32)."""
        g = self.group_size
        n, k = self.q.shape
        w = self.q.view(n, k // g, g).float() * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def dequantize_unpermuted(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in the checkpoint's own column order (``perm`` undone)."""
        w = self.dequantize(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, start: int, length: int) -> QuantizedWeight:
        """Output rows ``[start, start + length)`` (a column-parallel rank's part)."""
        sl = slice(start, start + length)
        return replace(self, q=self.q[sl], scale=self.scale[sl], offset=self.offset[sl])

    def columns(self, start: int, length: int) -> QuantizedWeight:
        """Input columns ``[start, start + length)`` (a row-parallel rank's part). Raises ``ValueError``
        when the range does not fall on group boundaries or the weight is permuted."""
        g = self.group_size
        if start == 0 and length == self.q.shape[1]:
            return self
        if self.perm is not None:
            raise ValueError("a column slice of an act-order (permuted) weight is not supported")
        if g == self.q.shape[1]:  # per channel: every slice keeps the row's one scale
            return replace(self, q=self.q[:, start : start + length], group_size=length)
        if start % g or length % g:
            raise ValueError(f"columns [{start}, {start + length}) do not fall on groups of {g}")
        gs = slice(start // g, (start + length) // g)
        return replace(
            self, q=self.q[:, start : start + length], scale=self.scale[:, gs], offset=self.offset[:, gs]
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights by output rows (fused qkv / gate_up); they must share bits, group and order."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size) != (first.bits, first.group_size):
                raise ValueError("fused parts differ in bits or group size")
            if (p.perm is None) != (first.perm is None) or (
                p.perm is not None and not torch.equal(p.perm, first.perm)
            ):
                raise ValueError("fused parts differ in their act-order permutation")
        return replace(
            first,
            q=torch.cat([p.q for p in parts]),
            scale=torch.cat([p.scale for p in parts]),
            offset=torch.cat([p.offset for p in parts]),
        )

    def regroup(self, group_size: int) -> QuantizedWeight:
        """The same weight with scales repeated into smaller groups (``group_size`` divides the old)."""
        if group_size == self.group_size:
            return self
        if self.group_size % group_size:
            raise ValueError(f"cannot regroup groups of {self.group_size} into {group_size}")
        r = self.group_size // group_size
        return replace(
            self,
            scale=self.scale.repeat_interleave(r, dim=1),
            offset=self.offset.repeat_interleave(r, dim=1),
            group_size=group_size,
        )

    def nbytes(self) -> int:
        """Bytes of the canonical form (q at its bit width, fp32 scales and offsets)."""
        return self.q.numel() * self.bits // 8 + 8 * self.scale.numel()


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` → ``[..., N]`` through the dequantized weight (the reference)."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm.to(x.device))
    return F.linear(x, w.dequantize(x.dtype).to(x.device), bias)


# --------------------------------------------------------------------------- packed kernels


class PackedLinear:
    """A weight laid out for one kernel: ``tensors`` (moved with the module), ``__call__(x)``.

    Subclasses: ``accepts(w, device)`` says whether the kernel can run ``w``; ``pack(w, dtype)``
    builds the layout; ``matmul(x)`` computes ``x [M, K] @ W^T`` → ``[M, N]``.
    """

    name = "?"

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype):
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        self.perm = w.perm
        self.tensors: dict[str, torch.Tensor] = {}
        self.pack(w, dtype)

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        raise NotImplementedError

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` → ``[..., N]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        return self.matmul(x2.contiguous()).view(*lead, self.out_features).to(x.dtype)

    def to(self, device: torch.device) -> PackedLinear:
        """Move every tensor to ``device`` (in place); returns self."""
        self.tensors = {k: v.to(device) for k, v in self.tensors.items()}
        if self.perm is not None:
            self.perm = self.perm.to(device)
        return self

    def nbytes(self) -> int:
        """Resident bytes of the packed layout (permutation included)."""
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return total + (0 if self.perm is None else self.perm.numel() * self.perm.element_size())


def _int4pack_group(w: QuantizedWeight) -> int | None:
    """The int4pack group size for ``w``: its own, or the largest accepted one dividing it; None
    when there is none or the output features are not a multiple of 16 (the op's tiles)."""
    if w.shape[0] % 16:
        return None
    for g in INT4PACK_GROUPS:
        if w.group_size % g == 0 and w.shape[1] % g == 0:
            return g
    return None


def _int4pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
    """aten's layout: packed ``[N, K / 2]`` uint8 and ``[K / G, N, 2]`` (scale, zero) in ``dtype``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scale_zero


class Int4Pack(PackedLinear):
    """``aten._weight_int4pack_mm_for_cpu``: bits <= 4, groups of 32/64/128/256, CPU."""

    name = "int4pack"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and w.bits <= 4 and _int4pack_group(w) is not None

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        w = w.regroup(_int4pack_group(w))
        self.group = w.group_size
        packed, sz = _int4pack(w.q, w.scale, w.offset + 8 * w.scale, dtype)
        self.tensors = {"packed": packed, "scale_zero": sz}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["packed"], self.group, t["scale_zero"])


class Int4PackX2(PackedLinear):
    """5- to 8-bit weights as two int4pack matmuls: ``q = 16 hi + lo``, so
    ``W = hi * (16 s) + lo * s + offset`` (both halves exact in int4)."""

    name = "int4pack_x2"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and 4 < w.bits <= 8 and _int4pack_group(w) is not None

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        w = w.regroup(_int4pack_group(w))
        self.group = w.group_size
        hi, lo = w.q >> 4, w.q & 15
        s16 = 16 * w.scale
        hi_packed, hi_sz = _int4pack(hi, s16, w.offset + 8 * s16, dtype)
        lo_packed, lo_sz = _int4pack(lo, w.scale, 8 * w.scale, dtype)
        self.tensors = {"hi": hi_packed, "hi_sz": hi_sz, "lo": lo_packed, "lo_sz": lo_sz}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t, g = self.tensors, self.group
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["hi"], g, t["hi_sz"])
        return y.add_(torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["lo"], g, t["lo_sz"]))


class Int8Pack(PackedLinear):
    """``aten._weight_int8pack_mm``: per-channel scales (one group per row), bits <= 8, CPU."""

    name = "int8pack"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and w.bits <= 8 and w.group_size == w.shape[1]

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        scale, offset = w.scale[:, 0], w.offset[:, 0]
        q = (w.q.to(torch.int16) - 128).to(torch.int8).contiguous()
        correction = offset + 128 * scale  # W = (q - 128) * s + (offset + 128 s)
        self.tensors = {"q": q, "scale": scale.to(dtype).contiguous()}
        self.has_correction = bool(correction.abs().max() > 0)
        if self.has_correction:
            self.tensors["correction"] = correction.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        y = torch.ops.aten._weight_int8pack_mm(x, t["q"], t["scale"])
        if self.has_correction:
            y = y + x.sum(-1, keepdim=True) * t["correction"]
        return y


class Dequant(PackedLinear):
    """Dequantize, then ``F.linear``: the reference, for any bits, group and device. Keeps ``q`` at
    one byte per value (two 4-bit values per byte), scales and offsets in fp32."""

    name = "dequant"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return True

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.bits, self.group = w.bits, w.group_size
        q = w.q
        if w.bits <= 4 and q.shape[1] % 2 == 0:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.tensors = {"q": q.contiguous(), "scale": w.scale.contiguous(), "offset": w.offset.contiguous()}

    def weight(self) -> torch.Tensor:
        """The dequantized ``[N, K]`` in the compute dtype."""
        t = self.tensors
        return self._dequantize(t["q"], t["scale"], t["offset"])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids [T]`` → ``[T, K]`` in the compute dtype (an embedding lookup)."""
        t = self.tensors
        return self._dequantize(t["q"][ids], t["scale"][ids], t["offset"][ids])

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        n, k, g = q.shape[0], self.in_features, self.group
        if q.shape[1] != k:  # two 4-bit values per byte
            q = torch.stack([q & 15, q >> 4], dim=-1).view(n, k)
        w = q.view(n, k // g, g).to(torch.float32) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
        return w.view(n, k).to(self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


KERNELS: dict[str, type[PackedLinear]] = {k.name: k for k in (Int4Pack, Int4PackX2, Int8Pack, Dequant)}
"""Every kernel by name; ``Dequant`` is the reference the others are tested against."""


def kernels_for(device: torch.device) -> dict[str, type[PackedLinear]]:
    """``KERNELS`` plus, on the CPU where a C++ compiler builds it, the few-row C++ kernel
    (``fuseserve.kernels.cpu_quant_linear``), and on CUDA where Triton imports, the Triton GEMM
    (``fuseserve.kernels.triton_quant_linear``)."""
    kernels = dict(KERNELS)
    if torch.device(device).type == "cpu":
        from fuseserve.kernels import cpu_quant_linear

        if cpu_quant_linear.available():
            kernels[cpu_quant_linear.CpuQuantGemv.name] = cpu_quant_linear.CpuQuantGemv
    if torch.device(device).type == "cuda":
        try:
            from fuseserve.kernels.triton_quant_linear import TritonQuantLinear
        except ImportError:
            return kernels
        kernels[TritonQuantLinear.name] = TritonQuantLinear
    return kernels


def candidates(w: QuantizedWeight, device: torch.device) -> list[str]:
    """Names of the kernels that accept ``w`` on ``device``."""
    return [name for name, k in kernels_for(device).items() if k.accepts(w, device)]


def choose_kernel(w: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> str:
    """The fastest kernel for ``w`` among ``candidates``, by measurement on random inputs of 1 and
    16 rows (each candidate first checked against the reference: relative error ≤ 1e-3 in fp32,
    ≤ 3e-2 in 16-bit types). Cached per (shape, bits, group, act-order, dtype, device)."""
    return _choose(tuple(w.shape), w.bits, w.group_size, w.perm is not None, dtype, str(device))


@functools.cache
def _choose(shape, bits, group, permuted, dtype, device) -> str:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    w = _probe_weight(shape, bits, group, gen)
    names = candidates(w, device)
    if len(names) == 1:
        return names[0]
    xs = [torch.randn(m, shape[1], generator=gen).to(dtype).to(device) for m in (1, 16)]
    ref = Dequant(w, dtype).to(device)
    want = [ref(x).float() for x in xs]
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    kernels: dict[str, PackedLinear] = {}
    classes = kernels_for(device)
    for name in names:
        kernel = ref if name == "dequant" else classes[name](w, dtype).to(device)
        got = [kernel(x).float() for x in xs]
        if any((g - r).norm() > tol * r.norm() for g, r in zip(got, want, strict=True)):
            log.warning("quantized kernel %s disagrees with the reference on %s; not used", name, shape)
            continue
        kernels[name] = kernel
    times = _race(kernels, xs)
    best = min(times, key=times.get)
    log.info(
        "quantized linear %s %d-bit g%d %s: %s (%s)",
        shape,
        bits,
        group,
        str(dtype).split(".")[-1],
        best,
        ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items()),
    )
    return best


def _probe_weight(shape, bits, group, gen: torch.Generator | None = None) -> QuantizedWeight:
    """A random weight of this shape and format (for eligibility and timing)."""
    n, k = shape
    gen = gen or torch.Generator().manual_seed(0)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    offset = -scale * 2 ** (bits - 1) + torch.randn(n, k // group, generator=gen) * 1e-3
    return QuantizedWeight(q, scale, offset, bits, group)


def _race(kernels: dict[str, PackedLinear], xs: list[torch.Tensor], rounds: int = 4) -> dict[str, float]:
    """Seconds per kernel: the sum over ``xs`` of the fastest of ``rounds`` calls, the kernels taking
    turns within each round (on a shared, noisy CPU the minimum of interleaved runs is the fair
    comparison). A kernel over 3x slower than the best after the first round runs no more."""
    best = {name: [float("inf")] * len(xs) for name in kernels}
    for r in range(rounds):
        for name, kernel in kernels.items():
            for i, x in enumerate(xs):
                _sync(x)
                start = time.perf_counter()
                kernel(x)
                _sync(x)
                best[name][i] = min(best[name][i], time.perf_counter() - start)
        if r == 0:
            fastest = min(sum(v) for v in best.values())
            kernels = {name: k for name, k in kernels.items() if sum(best[name]) <= 3 * fastest}
    return {name: sum(v) for name, v in best.items()}


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def pack(
    w: QuantizedWeight | Float8Weight, dtype: torch.dtype, device: torch.device, kernel: str | None = None
) -> PackedLinear:
    """``w`` laid out for ``kernel`` (default: ``choose_kernel``) in compute ``dtype`` on ``device``
    (a ``Float8Weight`` always as ``FP8Weight``).

    Raises ``ValueError`` for a kernel that does not accept ``w`` on ``device``.
    """
    device = torch.device(device)
    if isinstance(w, Float8Weight):
        return FP8Weight(w.weight, w.scale, dtype).to(device)
    name = kernel or choose_kernel(w, dtype, device)
    cls = kernels_for(device)[name]
    if not cls.accepts(w, device):
        raise ValueError(
            f"kernel {name} does not accept a {w.bits}-bit weight {w.shape} in groups of {w.group_size}"
        )
    return cls(w, dtype).to(device)


# --------------------------------------------------------------------------- FP8 weights


@dataclass
class Float8Weight:
    """A float8 weight in canonical form: ``W[n, k] = weight[n, k] * scale[n]``.

    weight: ``[N, K]`` ``torch.float8_e4m3fn``; scale: ``[N]`` float32 (a per-tensor scale repeated).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``."""
        return (self.weight.to(torch.float32) * self.scale.unsqueeze(1)).to(dtype)

    dequantize_unpermuted = dequantize

    def rows(self, start: int, length: int) -> Float8Weight:
        return Float8Weight(self.weight[start : start + length], self.scale[start : start + length])

    def columns(self, start: int, length: int) -> Float8Weight:
        return Float8Weight(self.weight[:, start : start + length], self.scale)

    @staticmethod
    def cat_rows(parts: list[Float8Weight]) -> Float8Weight:
        return Float8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


class FP8Weight(PackedLinear):
    """float8 e4m3 weight-only: ``W = w_fp8 * scale`` (per tensor ``[1]`` or per channel ``[N]``),
    dequantized to the compute dtype per call (the weight stays 1 byte per value)."""

    name = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.perm = dtype, None
        self.tensors = {"weight": weight.contiguous(), "scale": scale.float().reshape(-1, 1).contiguous()}

    def weight(self) -> torch.Tensor:
        t = self.tensors
        return (t["weight"].to(torch.float32) * t["scale"]).to(self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())
