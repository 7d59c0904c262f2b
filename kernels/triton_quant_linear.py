"""Triton W4A16 / W8A16 GEMM: ``y = x W^T`` with ``W`` dequantized inside the kernel, tile by tile.

The weight is the canonical form of ``fuseserve.kernels.quant_linear`` (``W = q * scale + offset`` in
groups of ``G`` input features, ``G`` a multiple of 32) laid out for the kernel:

- 4-bit: ``packed [N, K / 2]`` uint8; byte ``j`` of each 32-value block holds value ``j`` in its low
  nibble and value ``16 + j`` in its high nibble (the low and high halves of a block are then two
  ``[16]``-wide tiles, no interleave);
- 8-bit: ``q [N, K]`` uint8 as is.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y`` over its share of K; per ``BLOCK_K``-wide
step (32, or 64 / 128 where K and the group allow) it loads the low and high 16-value halves of each
32-value block of ``x`` and of the weight's integers, and adds
``(x_lo q_lo^T + x_hi q_hi^T) * scale + sum(x) * offset`` (a step lies inside one group; the offset term
needs only the row sums of ``x``), accumulating in fp32. With K split over programs (``split_k``,
passes of at most 16 rows) each writes an fp32 partial sum, added in a fixed order after. The
integers enter ``tl.dot`` in the activation dtype (exact: at most 255); fp32 activations use IEEE
products (no TF32). Tested against the reference on the CPU with
``TRITON_INTERPRET=1`` (``tests/unit/test_triton_quant_linear.py``).
"""

from __future__ import annotations

import functools

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
    tiles_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_ys,
    BITS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # this program's share of K: tiles [pid_k * tiles_per_split, ...)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_K // 2)  # a tile's low halves: value 32 * (t // 16) + t % 16 of the tile
    lo = (t // 16) * 32 + t % 16
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, K // BLOCK_K)
    for kb in range(first, last):
        k0 = kb * BLOCK_K
        x_rows = x_ptr + rm[:, None] * stride_xm
        x_lo = tl.load(x_rows + (k0 + lo)[None, :], mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16 + lo)[None, :], mask=mask_m[:, None], other=0.0)
        w_rows = w_ptr + rn[:, None] * stride_wn
        if BITS == 4:
            p = tl.load(w_rows + (k0 // 2 + t)[None, :], mask=mask_n[:, None], other=0)
            q_lo = (p & 15).to(x_lo.dtype)
            q_hi = (p >> 4).to(x_lo.dtype)
        else:
            q_lo = tl.load(w_rows + (k0 + lo)[None, :], mask=mask_n[:, None], other=0).to(x_lo.dtype)
            q_hi = tl.load(w_rows + (k0 + 16 + lo)[None, :], mask=mask_n[:, None], other=0).to(x_lo.dtype)
        if IEEE:
            part = tl.dot(x_lo, tl.trans(q_lo), input_precision="ieee")
            part += tl.dot(x_hi, tl.trans(q_hi), input_precision="ieee")
        else:
            part = tl.dot(x_lo, tl.trans(q_lo)) + tl.dot(x_hi, tl.trans(q_hi))
        g = k0 // group  # the tile lies in one group: BLOCK_K divides the group
        s = tl.load(scale_ptr + rn * stride_sn + g, mask=mask_n, other=0.0)
        o = tl.load(offset_ptr + rn * stride_sn + g, mask=mask_n, other=0.0)
        row_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        acc += part * s[None, :] + row_sum[:, None] * o[None, :]
    out = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def pack_weight(w: QuantizedWeight) -> torch.Tensor:
    """The kernel's integer layout of ``w``: ``[N, K / 2]`` nibbles (bits <= 4) or ``[N, K]`` (8)."""
    if w.bits > 4:
        return w.q.contiguous()
    n, k = w.q.shape
    blocks = w.q.view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def quant_matmul(
    x: torch.Tensor,
    w_int: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group: int,
    split_k: bool = False,
) -> torch.Tensor:
    """``x [M, K]`` @ W^T → ``[M, N]`` in ``x.dtype``; ``w_int`` from ``pack_weight``, ``scale`` and
    ``offset`` ``[N, K / group]`` float32. Raises ``ValueError`` when K or the group is not a multiple
    of 32.

    Tiles: 16 or 32 rows x 32 outputs x 32 of K per step, the whole of K in one program. With
    ``split_k`` and at most 16 rows (a decode pass) the config of ``decode_config`` instead: wider K
    steps and K split over programs, their fp32 partial sums added in a fixed order (deterministic)."""
    m, k = x.shape
    n = scale.shape[0]
    if k % BLOCK_K or group % BLOCK_K:
        raise ValueError(f"K ({k}) and the group ({group}) must be multiples of {BLOCK_K}")
    x = x.contiguous()
    block_m = 16 if m <= 16 else 32
    block_n, block_k, splits = 32, BLOCK_K, 1
    if split_k and m <= 16:
        block_n, block_k, splits = decode_config(n, k, group, _programs_wanted(x.device))
    tiles = k // block_k
    per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_split)  # none empty
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _quant_matmul_kernel[grid](
        x, w_int, scale, offset, out, m, n, k, group, per_split,
        x.stride(0), w_int.stride(0), scale.stride(0), n, m * n,
        BITS=4 if bits <= 4 else 8, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    if splits > 1:
        y.copy_(out.sum(dim=0))  # a fixed-order reduction: no atomics, the same bits every run
    return y


@functools.cache  # per layer shape: called on every eager decode matmul
def decode_config(n: int, k: int, group: int, programs: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, splits)`` for a pass of at most 16 rows: 64 outputs per program, K steps
    of the widest of 128 / 64 / 32 that divides both K and the group (one scale per step), and K split
    until the grid has about ``programs`` programs (each keeps at least one step). A decode GEMM reads
    each weight once: with the whole of K per program a 4096-output layer had 128 programs walking
    K in 512-byte steps, too few loads in flight for a GPU's memory."""
    block_k = next(b for b in (128, 64, BLOCK_K) if k % b == 0 and group % b == 0)
    block_n = 64
    tiles = k // block_k
    splits = max(1, min(tiles, 16, -(-programs // triton.cdiv(n, block_n))))
    return block_n, block_k, splits


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """About four programs per streaming multiprocessor (8 off CUDA: the interpreter)."""
    if device.type != "cuda":
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


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

    split_k = False

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        return quant_matmul(x, t["w"], t["scale"], t["offset"], self.bits, self.group, self.split_k)


class TritonQuantLinearSplitK(TritonQuantLinear):
    """``TritonQuantLinear`` with ``decode_config``'s split-K tiles for passes of at most 16 rows (the
    same tiles beyond). A separate candidate: ``choose_kernel`` keeps it only where it measures faster."""

    name = "triton-splitk"
    split_k = True
