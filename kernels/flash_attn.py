"""Adapter to flash-attn 2's varlen attention over the paged KV cache (Ampere, SM80, and newer).

One ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, ..., block_table=...)``
call serves a whole SplitFuse pass: with ``causal=True`` flash-attn aligns each chunk's queries to the
*end* of its keys (query i of a chunk of ``sq`` over ``sk`` keys sits at key position
``i + sk - sq``), which is exactly "a chunk continues its sequence's earlier KV". Keys of sequence i
are ``cu_seqlens_k[i]..cu_seqlens_k[i+1]`` in that numbering, i.e. its context length, read through
its block-table row.

Mapping of fuseserve's per-layer options (reference semantics in ``fuseserve.kernels.reference``):
- sliding window W (a query at p sees keys ``> p - W``) → ``window_size=(W - 1, 0)``;
- logit soft-cap c (``c * tanh(s / c)``) → ``softcap=c`` (0 disables it).

flash-attn's own constraints, checked before use (``unsupported_reason``): fp16/bf16 only, and a
paged cache whose block size is a multiple of 256 (flash-attn 2 rejects smaller pages). The pass's
K/V are written by the Triton KV-write kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_MULTIPLE = 256  # flash-attn 2 paged KV: page_block_size % 256 == 0


def import_error() -> str | None:
    """None when ``flash_attn`` imports, else why not (one line)."""
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA extension raising OSError/RuntimeError
        return f"flash_attn does not import ({type(e).__name__}: {e})"
    return None


def unsupported_reason(
    device: torch.device | None, block_size: int | None, dtype: torch.dtype | None
) -> str | None:
    """None when flash-attn can serve this worker, else the first reason it cannot."""
    if device is None or device.type != "cuda":
        return "flash-attn needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flash-attn needs SM80 or newer; this GPU is SM{major}{minor}"
    reason = import_error()
    if reason:
        return reason
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports float16 and bfloat16, not {dtype}"
    if block_size is not None and block_size % PAGE_MULTIPLE:
        return f"flash-attn's paged KV needs a block size that is a multiple of {PAGE_MULTIPLE}, not {block_size}"
    return None


@dataclass
class FlashAttnPlan:
    """Per-pass tensors for ``flash_attn_varlen_func``.

    cu_seqlens_q / cu_seqlens_k: ``[S+1]`` int32 prefix sums of chunk lengths / context lengths.
    max_seqlen_q / max_seqlen_k: the longest chunk / context (tokens). block_tables: ``[S, max_blocks]``
    int32, contiguous. slot_mapping: ``[T]`` int64 KV slot of each token.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


def plan_attention(
    query_lens: list[int],
    context_lens: list[int],
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> FlashAttnPlan:
    """Plan one pass: chunk lengths and context lengths (host lists) plus the batch's device tensors."""
    device = slot_mapping.device
    cu_k = [0]
    for n in context_lens:
        cu_k.append(cu_k[-1] + n)
    return FlashAttnPlan(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_seqlen_q=max(query_lens, default=0),
        max_seqlen_k=max(context_lens, default=0),
        block_tables=block_tables.to(torch.int32).contiguous(),
        slot_mapping=slot_mapping,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: FlashAttnPlan,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """``q [T, H, D]`` over the paged caches ``[num_blocks, block_size, KVH, D]`` → ``[T, H, D]``.

    The pass's K/V must already be in the cache. Raises ``ImportError`` without flash-attn.
    """
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        softcap=float(soft_cap or 0.0),
        block_table=plan.block_tables,
    )
