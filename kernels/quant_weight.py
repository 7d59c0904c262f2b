"""The canonical form of a weight-only quantized matrix, and the reference matmul over it.

Every weight-only format (GPTQ, AWQ, compressed-tensors' pack-quantized, GGUF's Q4_0 ... Q6_K) is
turned once, at load, into one canonical form, ``QuantizedWeight``:

    W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]

with ``q`` unsigned integers of ``bits`` bits, ``G`` the group size along the input features and,
for GPTQ's act-order (``desc_act``), a column permutation ``perm`` so that groups are contiguous:
the layer then computes ``x[:, perm] @ W^T``. A zero point ``z`` is ``offset = -scale * z``.
``Float8Weight`` is the float8 (e4m3) counterpart, ``W[n, k] = weight[n, k] * scale[n]``.

Both slice for tensor parallelism (``rows``, ``columns``) and stack fused parts (``cat_rows``);
``fuseserve.kernels.quant_kernels`` lays them out for a matmul kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


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
