"""PyTorch reference for paged ragged attention and the KV-cache write (the CPU path).

Every other kernel (Triton, flash-attn) is tested against these functions. Shapes:
``q [T, num_heads, head_dim]``, ``k/v [T, num_kv_heads, head_dim]``, caches
``[num_blocks, block_size, num_kv_heads, head_dim]``. Causal attention of each query to its own
sequence's keys at positions ``<=`` its own; with a sliding window W a query at position p sees
keys at positions ``> p - W`` (Mistral, as in ``transformers``).

Decode tokens (query length 1) of all sequences run as one padded batched call; prefill chunks
(which attend to earlier chunks through the cache) run one call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at flat slots ``slot_mapping [T]`` (in place)."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def context_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Flat slots ``[context_len]`` of positions ``0..context_len-1`` of a sequence."""
    num_blocks = -(-context_len // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[:num_blocks, None].long() * block_size + offsets).flatten()[:context_len]


@dataclass
class PrefillChunk:
    """One multi-token chunk: tokens ``start:end`` of the pass, keys at ``slots``, ``mask [q, ctx]`` or None=causal."""

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class TorchAttentionPlan:
    """Per-pass index tensors, built once and reused by every layer."""

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None = None  # [Sd] tokens that are single-token chunks
    decode_slots: torch.Tensor | None = None  # [Sd, Lmax] context slots, padded with slot 0
    decode_mask: torch.Tensor | None = None  # [Sd, 1, 1, Lmax] True where a key is visible
    prefills: list[PrefillChunk] = field(default_factory=list)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def plan_attention(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> TorchAttentionPlan:
    """Group a ragged batch into one batched decode call plus one call per prefill chunk."""
    device = slot_mapping.device
    plan = TorchAttentionPlan(slot_mapping=slot_mapping)
    dec_idx, dec_rows = [], []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        slots = context_slots(block_tables[i], ctx_len, block_size)
        if q_len == 1:
            dec_idx.append(start)
            dec_rows.append(slots)
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
            mask = None
            if ctx_len != q_len or (sliding_window is not None and ctx_len > sliding_window):
                mask = _visible(q_pos, torch.arange(ctx_len, device=device), sliding_window)
            plan.prefills.append(PrefillChunk(start, start + q_len, slots, mask))
        start += q_len
    if dec_rows:
        lmax = max(len(r) for r in dec_rows)
        lens = torch.tensor([len(r) for r in dec_rows], device=device)
        plan.decode_slots = torch.stack([F.pad(r, (0, lmax - len(r))) for r in dec_rows])
        k_pos = torch.arange(lmax, device=device)
        mask = k_pos[None, :] < lens[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (lens[:, None] - 1) - sliding_window
        plan.decode_mask = mask[:, None, None, :]
        plan.decode_token_idx = torch.tensor(dec_idx, device=device)
    return plan


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchAttentionPlan, scale: float
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over each sequence's cached keys/values → ``[T, H, D]``.

    The current tokens' K/V must already be written (``write_kv``).
    """
    num_heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    out = torch.empty_like(q)
    gqa = num_heads != kvh
    if plan.decode_token_idx is not None:
        qd = q[plan.decode_token_idx].unsqueeze(2)  # [Sd, H, 1, D]
        kd = k_flat[plan.decode_slots].transpose(1, 2)  # [Sd, KVH, L, D]
        vd = v_flat[plan.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[plan.decode_token_idx] = od.squeeze(2)
    for c in plan.prefills:
        qp = q[c.start : c.end].transpose(0, 1)  # [H, q, D]
        kp = k_flat[c.slots].transpose(0, 1)  # [KVH, L, D]
        vp = v_flat[c.slots].transpose(0, 1)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=gqa
        )
        out[c.start : c.end] = op.transpose(0, 1)
    return out
