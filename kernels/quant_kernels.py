"""Weight-only quantized matmul kernels: a ``QuantizedWeight`` laid out once for one kernel.

Each kernel is a ``PackedLinear`` subclass (``KERNELS`` by name):

- ``int4pack``: PyTorch's ``aten._weight_int4pack_mm_for_cpu`` (bits <= 4, group 32/64/128/256,
  output features a multiple of 16),
  which computes ``(q - 8) * s + z`` per element, so ``z = offset + 8 * scale``;
- ``int4pack_x2``: 5- to 8-bit weights as two int4pack matmuls, ``q = 16 * hi + lo`` (exact);
- ``int8pack``: ``aten._weight_int8pack_mm`` (per-channel scales only), ``q - 128`` as int8, the
  offset added back as ``x.sum(-1) * (offset + 128 * scale)``;
- ``dequant``: dequantize to the compute dtype, then ``F.linear`` (the reference; any shape, any
  device).

``FP8Weight`` runs a ``Float8Weight`` (dequantized per call). The C++ few-row kernel
(``cpu_quant_linear``) and the Triton GEMM (``triton_quant_linear``) are ``PackedLinear`` subclasses in
their own modules; ``fuseserve.kernels.quant_linear`` chooses among them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuseserve.kernels.quant_weight import QuantizedWeight

INT4PACK_GROUPS = (256, 128, 64, 32)  # group sizes aten's int4pack kernel accepts, largest first


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
