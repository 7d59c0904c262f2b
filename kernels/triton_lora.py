"""Triton SGMV shrink and expand: the LoRA deltas of a pass's adapters, segment by segment.

Same computation as ``fuseserve.kernels.lora_reference`` (Punica's SGMV, Chen et al. 2023): the pass
is cut into *segments*, runs of consecutive tokens of one adapter slot (``seg_starts [S + 1]`` token
offsets, ``seg_slots [S]``, -1 for the base model's tokens, which both kernels skip).

- ``sgmv_shrink(x, a, seg_starts, seg_slots, max_seg_len) -> s [T, K]`` fp32: each program computes a
  ``[BLOCK_M, BLOCK_N]`` tile of one segment's ``x @ a[slot]``, looping over ``in``;
- ``sgmv_expand(s, b, seg_starts, seg_slots, max_seg_len, y)``: ``y += s @ b[slot]`` tile by tile
  over ``out``, looping over ``K`` (small: ranks), read-modify-write of ``y`` (no two programs touch
  the same tile).

Accumulation is fp32; fp32 inputs use IEEE products (no TF32). Tested against the reference on the
CPU with ``TRITON_INTERPRET=1`` (``tests/unit/test_triton_lora.py``); bfloat16 tiles are widened to
fp32 there (the interpreter cannot multiply bfloat16).
"""

from __future__ import annotations

import torch

from fuseserve.kernels.triton_runtime import INTERPRETED, tl, triton


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    s_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    IN,
    K,
    stride_xm,
    stride_al,
    stride_ai,
    stride_sm,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    row0 = start + pid_m * BLOCK_M
    if slot >= 0:
        if row0 < end:
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_m = rm < end
            mask_n = rn < K
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a_base = a_ptr + slot.to(tl.int64) * stride_al
            for k0 in range(0, IN, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask_k = rk < IN
                xt = tl.load(
                    x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                )
                at = tl.load(
                    a_base + rk[:, None] * stride_ai + rn[None, :],
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0,
                )
                if UPCAST:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                if IEEE:
                    acc += tl.dot(xt, at, input_precision="ieee")
                else:
                    acc += tl.dot(xt, at)
            out = s_ptr + rm[:, None] * stride_sm + rn[None, :]
            tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(
    s_ptr,
    b_ptr,
    y_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    K,
    OUT,
    stride_sm,
    stride_bl,
    stride_bk,
    stride_ym,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    row0 = start + pid_m * BLOCK_M
    if slot >= 0:
        if row0 < end:
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_m = rm < end
            mask_n = rn < OUT
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            b_base = b_ptr + slot.to(tl.int64) * stride_bl
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                mask_k = rk < K
                st = tl.load(
                    s_ptr + rm[:, None] * stride_sm + rk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                )
                bt = tl.load(
                    b_base + rk[:, None] * stride_bk + rn[None, :],
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0,
                ).to(tl.float32)
                if IEEE:
                    acc += tl.dot(st, bt, input_precision="ieee")
                else:
                    acc += tl.dot(st, bt)
            out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else 32 if INTERPRETED else 64


def sgmv_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int
) -> torch.Tensor:
    """``x [T, in]``, ``a [L, in, K]`` (same dtype; any strides but the last, 1), segments (int32
    ``[S + 1]`` / ``[S]``, on ``x``'s device) → ``s [T, K]`` fp32; rows of base segments are zeros.
    ``max_seg_len``: the longest segment, in tokens (sizes the grid)."""
    t, k_in = x.shape
    k = a.shape[2]
    x = x.contiguous()
    if a.stride(2) != 1:
        a = a.contiguous()
    s = torch.zeros(t, k, dtype=torch.float32, device=x.device)
    num_segs = seg_slots.shape[0]
    if t == 0 or num_segs == 0 or k == 0:
        return s
    block_m = _block_m(max_seg_len)
    block_n = max(16, min(64, triton.next_power_of_2(k)))
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(k, block_n))
    _shrink_kernel[grid](
        x, a, s, seg_starts, seg_slots, k_in, k,
        x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED and x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32,
    )  # fmt: skip
    return s


def sgmv_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    y: torch.Tensor,
) -> torch.Tensor:
    """``y [T, out] += s [T, K] (fp32) @ b[slot] [K, out]`` per segment (base segments unchanged);
    returns ``y`` (contiguous rows required), changed in place."""
    t, k = s.shape
    out = b.shape[2]
    if y.stride(1) != 1:
        raise ValueError("sgmv_expand writes rows of y in place: its last dimension must be contiguous")
    num_segs = seg_slots.shape[0]
    if t == 0 or num_segs == 0 or k == 0:
        return y
    b = b.contiguous()
    block_m = _block_m(max_seg_len)
    block_n = 64 if INTERPRETED else 128
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(out, block_n))
    _expand_kernel[grid](
        s, b, y, seg_starts, seg_slots, k, out,
        s.stride(0), b.stride(0), b.stride(1), y.stride(0),
        IEEE=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16,
    )  # fmt: skip
    return y
