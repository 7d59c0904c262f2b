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


def context_blocks(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Block ids ``[ceil(context_len / block_size)]`` holding positions ``0..context_len-1``."""
    return block_table[: -(-context_len // block_size)].long()


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks (``blocks [...]``) out of ``cache`` → ``[..., n * block_size, kvh, d]``.

    Block-granular ``index_select`` moves ``block_size * kvh * d`` contiguous elements per index,
    which is much faster on CPU than gathering token slots one by one.
    """
    bs, kvh, d = cache.shape[1:]
    out = cache.index_select(0, blocks.reshape(-1))
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * bs, kvh, d)


@dataclass
class PrefillChunk:
    """One multi-token chunk: tokens ``start:end`` of the pass attending to ``context_len`` keys held
    in ``blocks``; ``mask [q, context_len]`` or None for plain causal."""

    start: int
    end: int
    blocks: torch.Tensor
    context_len: int
    mask: torch.Tensor | None


@dataclass
class TorchAttentionPlan:
    """Per-pass index tensors, built once and reused by every layer."""

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None = None  # [Sd] tokens that are single-token chunks
    decode_blocks: torch.Tensor | None = None  # [Sd, max_blocks] block ids, padded with block 0
    decode_mask: torch.Tensor | None = None  # [Sd, 1, 1, max_blocks * block_size] True where a key is visible
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
    dec_idx, dec_rows, dec_lens = [], [], []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        blocks = context_blocks(block_tables[i], ctx_len, block_size)
        if q_len == 1:
            dec_idx.append(start)
            dec_rows.append(blocks)
            dec_lens.append(ctx_len)
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
            mask = None
            if ctx_len != q_len or (sliding_window is not None and ctx_len > sliding_window):
                mask = _visible(q_pos, torch.arange(ctx_len, device=device), sliding_window)
            plan.prefills.append(PrefillChunk(start, start + q_len, blocks, ctx_len, mask))
        start += q_len
    if dec_rows:
        nmax = max(len(r) for r in dec_rows)
        lens = torch.tensor(dec_lens, device=device)
        plan.decode_blocks = torch.stack([F.pad(r, (0, nmax - len(r))) for r in dec_rows])
        # each decode query sits at position len - 1; padded keys lie beyond it and are masked
        mask = _visible(lens - 1, torch.arange(nmax * block_size, device=device), sliding_window)
        plan.decode_mask = mask[:, None, None, :]
        plan.decode_token_idx = torch.tensor(dec_idx, device=device)
    return plan


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchAttentionPlan, scale: float
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over each sequence's cached keys/values → ``[T, H, D]``.

    The current tokens' K/V must already be written (``write_kv``).
    """
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    gqa = q.shape[1] != kvh
    if plan.decode_token_idx is not None:
        qd = q[plan.decode_token_idx].unsqueeze(2)  # [Sd, H, 1, D]
        kd = gather_blocks(k_cache, plan.decode_blocks).transpose(1, 2)  # [Sd, KVH, L, D]
        vd = gather_blocks(v_cache, plan.decode_blocks).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[plan.decode_token_idx] = od.squeeze(2)
    for c in plan.prefills:
        # 4-D [1, heads, len, D]: the CPU flash kernel takes only batched input (3-D falls back to math)
        qp = q[c.start : c.end].transpose(0, 1).unsqueeze(0)
        kp = gather_blocks(k_cache, c.blocks)[: c.context_len].transpose(0, 1).unsqueeze(0)
        vp = gather_blocks(v_cache, c.blocks)[: c.context_len].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=gqa
        )
        out[c.start : c.end] = op[0].transpose(0, 1)
    return out
