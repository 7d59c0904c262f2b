"""Triton KV-cache write: this pass's keys and values stored at their slots of the paged caches.

Shapes follow ``fuseserve.kernels.reference``: ``k/v [T, KVH, D]``, caches
``[num_blocks, block_size, KVH, D]``, a flat slot (``block * block_size + offset``) per token.
Used by the Triton and the flash-attn backends (``fuseserve.worker.attention``). An fp8 cache
(``kv_quant``) is written as ``saturate(x / scale)`` in e4m3, like ``reference.write_kv``.
"""

from __future__ import annotations

import torch

from fuseserve.kernels import kv_quant
from fuseserve.kernels.triton_fp8 import fp8_encode
from fuseserve.kernels.triton_runtime import tl, triton

FP8_MAX: tl.constexpr = tl.constexpr(kv_quant.FP8_MAX)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_vcb,
    stride_vcs,
    inv_k_scale,
    inv_v_scale,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # KVH * HEAD_DIM
    ROW_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr,  # uint8 views of fp8 caches: scale, saturate, encode e4m3 (triton_fp8)
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, ROW_PAD)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (col < ROW)[None, :]
    head, d = col // HEAD_DIM, col % HEAD_DIM
    blk, off = slot // PAGE, slot % PAGE
    t64 = tok.to(tl.int64)
    k = tl.load(k_ptr + t64[:, None] * stride_kt + (head * stride_kh + d)[None, :], mask=ok)
    v = tl.load(v_ptr + t64[:, None] * stride_vt + (head * stride_vh + d)[None, :], mask=ok)
    if QUANT:
        k = fp8_encode(tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX))
        v = fp8_encode(tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX))
    tl.store(k_cache_ptr + (blk * stride_cb + off * stride_cs)[:, None] + col[None, :], k, mask=ok)
    tl.store(v_cache_ptr + (blk * stride_vcb + off * stride_vcs)[:, None] + col[None, :], v, mask=ok)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` ``[T, KVH, D]`` at flat slots ``slot_mapping [T]`` of the caches (in place).

    Same result as ``reference.write_kv`` (``index_copy_`` into the slots; an fp8 cache quantized
    with ``k_scale`` / ``v_scale``); a negative slot skips its token. The caches must be ``[num_blocks, block_size, KVH, D]`` with each slot's ``[KVH, D]``
    contiguous; ``k``/``v`` need a contiguous last dimension.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    kvh, d = k.shape[1], k.shape[2]
    check_cache(k_cache, kvh, d)
    check_cache(v_cache, kvh, d)
    k, v = last_contiguous(k), last_contiguous(v)
    quant = kv_quant.is_fp8(k_cache)
    if quant:  # the kernel writes raw e4m3 bytes (Triton's fp8 type converts only on SM89+)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_t = 16
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        HEAD_DIM=d,
        ROW=kvh * d,
        ROW_PAD=triton.next_power_of_2(kvh * d),
        PAGE=k_cache.shape[1],
        BLOCK_T=block_t,
        QUANT=quant,
    )


def check_cache(cache: torch.Tensor, kvh: int, d: int) -> None:
    """Raise ``ValueError`` unless ``cache`` is ``[num_blocks, block_size, kvh, d]`` with contiguous slots."""
    if cache.dim() != 4 or cache.shape[2:] != (kvh, d) or cache.stride(2) != d or cache.stride(3) != 1:
        raise ValueError(
            f"KV cache must be [num_blocks, block_size, {kvh}, {d}] with contiguous slots; "
            f"got shape {tuple(cache.shape)} strides {cache.stride()}"
        )


def last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dimension is contiguous, else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
