"""Triton W4A16 / W8A16 GEMM: ``y = x W^T`` with ``W`` dequantized inside the kernel, tile by tile.

The weight is the canonical form of ``fuseserve.kernels.quant_linear`` (``W = q * scale + offset`` in
groups of ``G`` input features, ``G`` a multiple of 32) laid out for the kernel:

- 4-bit: ``packed [N, K / 2]`` uint8; byte ``j`` of each 32-value block holds value ``j`` in its low
  nibble and value ``16 + j`` in its high nibble (the low and high halves of a block are then two
  ``[16]``-wide tiles, no interleave);
- 8-bit: ``q [N, K]`` uint8 as is.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``; per 32-wide block of K it loads the two
16-wide halves of ``x`` and of the weight's integers, and adds
``(x_lo q_lo^T + x_hi q_hi^T) * scale + sum(x) * offset`` (the offset term needs only the row sums of
``x``), accumulating in fp32. The integers enter ``tl.dot`` in the activation dtype (exact: at most
255); fp32 activations use IEEE products (no TF32). Tested against the reference on the CPU with
``TRITON_INTERPRET=1`` (``tests/unit/test_triton_quant_linear.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseserve.kernels.quant_kernels import PackedLinear
from fuseserve.kernels.quant_weight import QuantizedWeight

BLOCK_K = 32  # the kernel's K step: two 16-wide halves


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    offset_ptr,
    y_ptr,
    M,
    N,
    K,
    group,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BITS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 16)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 32):
        k0 = kb * 32
        x_rows = x_ptr + rm[:, None] * stride_xm
        x_lo = tl.load(x_rows + (k0 + j)[None, :], mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16 + j)[None, :], mask=mask_m[:, None], other=0.0)
        w_rows = w_ptr + rn[:, None] * stride_wn
        if BITS == 4:
            p = tl.load(w_rows + (kb * 16 + j)[None, :], mask=mask_n[:, None], other=0)
            q_lo = (p & 15).to(x_lo.dtype)
            q_hi = (p >> 4).to(x_lo.dtype)
        else:
            q_lo = tl.load(w_rows + (k0 + j)[None, :], mask=mask_n[:, None], other=0).to(x_lo.dtype)
            q_hi = tl.load(w_rows + (k0 + 16 + j)[None, :], mask=mask_n[:, None], other=0).to(x_lo.dtype)
        if IEEE:
            part = tl.dot(x_lo, tl.trans(q_lo), input_precision="ieee")
            part += tl.dot(x_hi, tl.trans(q_hi), input_precision="ieee")
        else:
            part = tl.dot(x_lo, tl.trans(q_lo)) + tl.dot(x_hi, tl.trans(q_hi))
        g = k0 // group
        s = tl.load(scale_ptr + rn * stride_sn + g, mask=mask_n, other=0.0)
        o = tl.load(offset_ptr + rn * stride_sn + g, mask=mask_n, other=0.0)
        row_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        acc += part * s[None, :] + row_sum[:, None] * o[None, :]
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def pack_weight(w: QuantizedWeight) -> torch.Tensor:
    """The kernel's integer layout of ``w``: ``[N, K / 2]`` nibbles (bits <= 4) or ``[N, K]`` (8)."""
    if w.bits > 4:
        return w.q.contiguous()
    n, k = w.q.shape
    blocks = w.q.view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def quant_matmul(
    x: torch.Tensor, w_int: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    """``x [M, K]`` @ W^T → ``[M, N]`` in ``x.dtype``; ``w_int`` from ``pack_weight``, ``scale`` and
    ``offset`` ``[N, K / group]`` float32. Raises ``ValueError`` when K or the group is not a multiple
    of 32."""
    m, k = x.shape
    n = scale.shape[0]
    if k % BLOCK_K or group % BLOCK_K:
        raise ValueError(f"K ({k}) and the group ({group}) must be multiples of {BLOCK_K}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32
    block_n = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, w_int, scale, offset, y, m, n, k, group,
        x.stride(0), w_int.stride(0), scale.stride(0), y.stride(0),
        BITS=4 if bits <= 4 else 8, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y


class TritonQuantLinear(PackedLinear):
    """``quant_matmul`` as a ``quant_linear`` kernel: CUDA, bits <= 8, K and group multiples of 32."""

    name = "triton"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return (
            device.type == "cuda"
            and w.bits <= 8
            and w.group_size % BLOCK_K == 0
            and w.shape[1] % BLOCK_K == 0
        )

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        self.bits, self.group = w.bits, w.group_size
        self.tensors = {"w": pack_weight(w), "scale": w.scale.contiguous(), "offset": w.offset.contiguous()}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        return quant_matmul(x, t["w"], t["scale"], t["offset"], self.bits, self.group)
