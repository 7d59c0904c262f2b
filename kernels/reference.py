"""PyTorch reference for paged ragged attention and the KV-cache write (the test oracle, and the CPU
fallback where the C++ operator in ``cpu_attention.py`` cannot be built).

Every other kernel (Triton, flash-attn) is tested against these functions. Shapes:
``q [T, num_heads, head_dim]``, ``k/v [T, num_kv_heads, head_dim]``, caches
``[num_blocks, block_size, num_kv_heads, head_dim]``. Causal attention of each query to its own
sequence's keys at positions ``<=`` its own; with a sliding window W a query at position p sees
keys at positions ``> p - W`` (Mistral, as in ``transformers``). With a logit soft-cap c (Gemma 2)
the scores ``s = scale * q.k`` become ``c * tanh(s / c)`` before masking and softmax.

The window and the soft-cap are per layer: ``plan_attention`` builds the per-pass index tensors once,
and the visibility masks of each window are built the first time a layer asks for them.

Decode tokens (query length 1) of all sequences run as one padded batched call; prefill chunks
(which attend to earlier chunks through the cache) run one call each.

An fp8 cache (``kv_quant``) is written quantized (``x / scale``, saturated) and its gathered blocks
are widened to the query's dtype before attention, the K scale folded into the softmax scale and the
V scale applied to the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fuseserve.kernels import kv_quant


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at flat slots ``slot_mapping [T]`` (in place);
    into an fp8 cache as ``kv_quant.quantize(k, k_scale)`` / ``(v, v_scale)``."""
    kvh, d = k.shape[1], k.shape[2]
    if kv_quant.is_fp8(k_cache):  # index_copy_ has no fp8 kernel: copy the bytes
        k = kv_quant.quantize(k, k_scale).view(torch.uint8)
        v = kv_quant.quantize(v, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def context_blocks(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Block ids ``[ceil(context_len / block_size)]`` holding positions ``0..context_len-1``."""
    return block_table[: -(-context_len // block_size)].long()


def gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Copy whole blocks (``blocks [...]``) out of ``cache`` → ``[..., n * block_size, kvh, d]``; an
    fp8 cache's blocks widened to ``dtype`` (unscaled stored values).

    Block-granular ``index_select`` moves ``block_size * kvh * d`` contiguous elements per index,
    which is much faster on CPU than gathering token slots one by one.
    """
    bs, kvh, d = cache.shape[1:]
    if kv_quant.is_fp8(cache):
        out = cache.view(torch.uint8).index_select(0, blocks.reshape(-1)).view(kv_quant.FP8).to(dtype)
    else:
        out = cache.index_select(0, blocks.reshape(-1))
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * bs, kvh, d)


@dataclass
class PrefillChunk:
    """One multi-token chunk: tokens ``start:end`` of the pass attending to ``context_len`` keys held
    in ``blocks``."""

    start: int
    end: int
    blocks: torch.Tensor
    context_len: int

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """``[q, context_len]`` visibility, or None when plain causal attention is exact."""
        q_len = self.end - self.start
        if self.context_len == q_len and (sliding_window is None or self.context_len <= sliding_window):
            return None
        device = self.blocks.device
        q_pos = torch.arange(self.context_len - q_len, self.context_len, device=device)
        return _visible(q_pos, torch.arange(self.context_len, device=device), sliding_window)


@dataclass
class TorchAttentionPlan:
    """Per-pass index tensors, built once and reused by every layer."""

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None = None  # [Sd] tokens that are single-token chunks
    decode_blocks: torch.Tensor | None = None  # [Sd, max_blocks] block ids, padded with block 0
    decode_lens: torch.Tensor | None = None  # [Sd] context length of each decode sequence
    block_size: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)  # sliding window → (decode mask, prefill masks)

    def masks(self, sliding_window: int | None) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Visibility masks for one window, built once per pass: the decode mask
        ``[Sd, 1, 1, max_blocks * block_size]`` (True where a key is visible) and one mask per prefill chunk."""
        if sliding_window not in self._masks:
            dec = None
            if self.decode_blocks is not None:
                keys = torch.arange(
                    self.decode_blocks.shape[1] * self.block_size, device=self.slot_mapping.device
                )
                # each decode query sits at position len - 1; padded keys lie beyond it and are masked
                dec = _visible(self.decode_lens - 1, keys, sliding_window)[:, None, None, :]
            self._masks[sliding_window] = (dec, [c.mask(sliding_window) for c in self.prefills])
        return self._masks[sliding_window]


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
) -> TorchAttentionPlan:
    """Group a ragged batch into one batched decode call plus one call per prefill chunk."""
    device = slot_mapping.device
    plan = TorchAttentionPlan(slot_mapping=slot_mapping, block_size=block_size)
    dec_idx, dec_rows, dec_lens = [], [], []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        blocks = context_blocks(block_tables[i], ctx_len, block_size)
        if q_len == 1:
            dec_idx.append(start)
            dec_rows.append(blocks)
            dec_lens.append(ctx_len)
        else:
            plan.prefills.append(PrefillChunk(start, start + q_len, blocks, ctx_len))
        start += q_len
    if dec_rows:
        nmax = max(len(r) for r in dec_rows)
        plan.decode_lens = torch.tensor(dec_lens, device=device)
        plan.decode_blocks = torch.stack([F.pad(r, (0, nmax - len(r))) for r in dec_rows])
        plan.decode_token_idx = torch.tensor(dec_idx, device=device)
    return plan


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of ``q [B, H, Lq, D]`` over ``k/v [B, KVH, Lk, D]`` → ``[B, H, Lq, D]``.

    ``mask`` (broadcastable to ``[B, H, Lq, Lk]``, True = visible) or None for causal attention with the
    queries at the last ``Lq`` key positions. Without a soft-cap this is PyTorch's fused SDPA; with one,
    the scores are capped (``c * tanh(s / c)``) in an explicit fp32 computation.
    """
    gqa = q.shape[1] != k.shape[1]
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = soft_cap * torch.tanh(s / soft_cap)
    if mask is None:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = _visible(torch.arange(lk - lq, lk, device=s.device), torch.arange(lk, device=s.device), None)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over each sequence's cached keys/values → ``[T, H, D]``.

    The current tokens' K/V must already be written (``write_kv``). ``sliding_window`` and
    ``soft_cap`` are this layer's (None: full causal attention, no cap). ``k_scale`` / ``v_scale``:
    an fp8 cache's scales (ignored for a float cache).
    """
    out = torch.empty_like(q)
    fp8 = kv_quant.is_fp8(k_cache)
    if fp8:
        scale = scale * k_scale
    decode_mask, prefill_masks = plan.masks(sliding_window)
    if plan.decode_token_idx is not None:
        qd = q[plan.decode_token_idx].unsqueeze(2)  # [Sd, H, 1, D]
        kd = gather_blocks(k_cache, plan.decode_blocks, q.dtype).transpose(1, 2)  # [Sd, KVH, L, D]
        vd = gather_blocks(v_cache, plan.decode_blocks, q.dtype).transpose(1, 2)
        od = sdpa(qd, kd, vd, decode_mask, scale, soft_cap)
        out[plan.decode_token_idx] = od.squeeze(2)
    for c, mask in zip(plan.prefills, prefill_masks, strict=True):
        out[c.start : c.end] = prefill_attention(q, k_cache, v_cache, c, mask, scale, soft_cap)
    if fp8 and v_scale != 1.0:
        out.mul_(v_scale)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """One prefill chunk's attention: ``q [T, H, D]``'s rows ``chunk.start:chunk.end`` over the chunk's
    ``context_len`` cached keys (gathered block by block) → ``[chunk tokens, H, D]``; ``mask`` from
    ``chunk.mask(window)`` (None: causal)."""
    # 4-D [1, heads, len, D]: the CPU flash kernel takes only batched input (3-D falls back to math)
    qp = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    kp = gather_blocks(k_cache, chunk.blocks, q.dtype)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
    vp = gather_blocks(v_cache, chunk.blocks, q.dtype)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
    return sdpa(qp, kp, vp, mask, scale, soft_cap)[0].transpose(0, 1)
