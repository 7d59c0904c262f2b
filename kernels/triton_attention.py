"""Triton paged ragged attention: one launch per layer for a whole SplitFuse pass (two with split-KV).

The host side of the Triton backend: ``plan_attention`` builds a pass's tensors once for every layer,
``paged_attention`` picks the launch's tile sizes and split-KV parts and launches the kernels of
``triton_attention_kernel`` (the algorithm is described there); ``write_kv`` (``triton_kv_write``)
stores the pass's keys and values first. Whether the kernels are compiled or interpreted is decided
in ``triton_runtime``.

Shapes follow ``fuseserve.kernels.reference``: ``q [T, H, D]``, ``k/v [T, KVH, D]``, caches
``[num_blocks, block_size, KVH, D]``; visibility and soft-cap semantics are the reference's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from fuseserve.kernels import kv_quant
from fuseserve.kernels.triton_attention_kernel import _merge_splits_kernel, _paged_attention_kernel
from fuseserve.kernels.triton_kv_write import check_cache, last_contiguous, write_kv
from fuseserve.kernels.triton_runtime import INTERPRETED, triton

__all__ = [
    "TritonAttentionPlan",
    "choose_num_splits",
    "choose_tiling",
    "paged_attention",
    "plan_attention",
    "static_plan",
    "write_kv",
]


@dataclass
class TritonAttentionPlan:
    """Per-pass tensors of one ragged batch, built once by ``plan_attention`` and reused by every layer.

    slot_mapping: ``[T]`` int64 KV slot of each token. cu_seqlens_q: ``[S+1]`` int32.
    context_lens: ``[S]`` int32 context length of each sequence after this pass.
    block_tables: ``[S, max_blocks]`` int32. query_lens: the chunk lengths (host list; None in a
    ``static_plan``, whose query blocks are given).
    num_splits: split-KV parts (None: chosen per launch from the grid size and the longest context).
    max_query_len: the longest chunk (1: a decode-only pass, tiled for it).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int] | None
    max_context_len: int
    block_size: int
    num_splits: int | None = None
    max_query_len: int = 1
    _query_blocks: dict = field(default_factory=dict)  # BLOCK_Q → (qb_seq, qb_start)

    def query_blocks(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qb_seq, qb_start)`` ``[NQB]`` int32: sequence and in-chunk start of each query block."""
        if block_q not in self._query_blocks:
            if self.query_lens is None:
                raise ValueError(
                    f"a static plan has query blocks of {list(self._query_blocks)} tokens, not {block_q}"
                )
            seq, start = query_blocks(self.query_lens, block_q)
            dev = self.slot_mapping.device
            self._query_blocks[block_q] = (
                torch.from_numpy(seq).to(dev, non_blocking=True),
                torch.from_numpy(start).to(dev, non_blocking=True),
            )
        return self._query_blocks[block_q]


def query_blocks(query_lens: list[int], block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """``(qb_seq, qb_start)`` int32 arrays ``[NQB]``: chunk ``i`` of ``query_lens[i]`` tokens is cut into
    ``ceil(query_lens[i] / block_q)`` query blocks; each block's chunk and first token within it."""
    lens = np.asarray(query_lens, dtype=np.int64)
    per_chunk = -(-lens // block_q)
    seq = np.repeat(np.arange(len(lens), dtype=np.int32), per_chunk)
    first = np.cumsum(per_chunk) - per_chunk  # each chunk's first block
    start = ((np.arange(len(seq)) - np.repeat(first, per_chunk)) * block_q).astype(np.int32)
    return seq, start


def plan_attention(
    query_lens: list[int],
    context_lens: list[int],
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    num_splits: int | None = None,
) -> TritonAttentionPlan:
    """Per-pass plan from the ragged batch's counts (host lists) and its device tensors."""
    return TritonAttentionPlan(
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        context_lens=seq_lens.to(torch.int32),
        block_tables=block_tables.to(torch.int32).contiguous(),
        query_lens=list(query_lens),
        max_context_len=max(context_lens, default=0),
        block_size=block_size,
        num_splits=num_splits,
        max_query_len=max(query_lens, default=0),
    )


def static_plan(
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    qb_seq: torch.Tensor,
    qb_start: torch.Tensor,
    tiling: Tiling,
    block_size: int,
    num_splits: int,
    max_query_len: int,
) -> TritonAttentionPlan:
    """A plan over fixed buffers, for a launch captured once and replayed (``cuda_graphs.py``): every
    launch reads the same tensors, with query blocks ``qb_seq / qb_start`` for ``tiling.block_q``,
    ``num_splits`` split-KV parts and the tiling of passes whose longest chunk is ``max_query_len``.
    The caller refills the buffers before each replay; query blocks past the pass's own point at a
    sequence of no tokens and context 0 (their programs do nothing)."""
    return TritonAttentionPlan(
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
        block_tables=block_tables,
        query_lens=None,
        max_context_len=0,
        block_size=block_size,
        num_splits=num_splits,
        max_query_len=max_query_len,
        _query_blocks={tiling.block_q: (qb_seq, qb_start)},
    )


MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 16


def choose_num_splits(num_programs: int, max_context_len: int, block_n: int, device: torch.device) -> int:
    """Split-KV parts for a launch of ``num_programs`` (query block, KV head) programs.

    Split only when the grid leaves most of the GPU's multiprocessors idle and the longest context
    spans enough tiles that each part keeps ``MIN_TILES_PER_SPLIT``; never on the interpreter.
    """
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    tiles = triton.cdiv(max_context_len, block_n)
    by_length = tiles // MIN_TILES_PER_SPLIT
    by_grid = triton.cdiv(2 * sms, num_programs)
    return max(1, min(by_length, by_grid, MAX_SPLITS))


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Tiling:
    """Tile sizes of one attention launch (the kernel's constexprs)."""

    group: int  # query heads per KV head (G)
    block_m: int  # rows per program: block_q tokens x group heads, padded to a power of two
    block_q: int  # query tokens per program (a query block)
    block_n: int  # keys per tile
    d_pad: int  # head dim padded to a power of two, at least 16


def choose_tiling(num_heads: int, head_dim: int, kv_heads: int, page: int, max_query_len: int) -> Tiling:
    """Tile sizes for queries of ``num_heads x head_dim`` over a cache of ``kv_heads`` heads in pages
    of ``page`` slots: at least 16 rows per program (``tl.dot``'s minimum), more when the pass has a
    prefill chunk (``max_query_len > 1``); one page per tile (at least 16 keys interpreted, 32 compiled)."""
    group = num_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len > 1:
        block_m = max(block_m, 64 if not INTERPRETED else 32)
    block_n = max(page, 16) if INTERPRETED else max(page, 32)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return Tiling(group=group, block_m=block_m, block_q=block_m // group, block_n=block_n, d_pad=d_pad)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over each sequence's cached keys/values → ``[T, H, D]``, one launch
    (two with split-KV). Caches in ``q``'s dtype, or fp8 (``kv_quant``) read with ``k_scale`` /
    ``v_scale`` (the K scale folded into ``scale``, the V scale applied to the output).

    The pass's own K/V must already be in the cache (``write_kv``). ``sliding_window`` W: a query at
    position p sees keys at positions ``> p - W``; ``soft_cap`` c: scores become ``c * tanh(s / c)``.
    Raises ``ValueError`` when the query heads are not a multiple of the KV heads or a cache's layout
    is not ``[num_blocks, block_size, KVH, D]`` with contiguous slots.
    """
    num_tokens, num_heads, head_dim = q.shape
    kvh = k_cache.shape[2]
    if num_heads % kvh:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kvh} KV heads")
    check_cache(k_cache, kvh, head_dim)
    check_cache(v_cache, kvh, head_dim)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    q = last_contiguous(q)
    fp8 = kv_quant.is_fp8(k_cache)
    if fp8:  # raw e4m3 bytes, decoded in the kernel (triton_fp8); K scale folded into the softmax scale
        scale = scale * k_scale
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    tiles = choose_tiling(num_heads, head_dim, kvh, k_cache.shape[1], plan.max_query_len)
    num_programs = plan.query_blocks(tiles.block_q)[0].shape[0] * kvh
    splits = plan.num_splits or choose_num_splits(num_programs, plan.max_context_len, tiles.block_n, q.device)
    part_acc, part_ml = _split_partials(out, splits, tiles.d_pad)
    _launch_attention(
        out, part_acc, part_ml, q, k_cache, v_cache, plan, tiles, splits, scale, sliding_window, soft_cap
    )
    if splits > 1:
        _launch_merge(out, part_acc, part_ml, splits, head_dim, tiles.d_pad)
    if fp8 and v_scale != 1.0:
        out.mul_(v_scale)
    return out


def _split_partials(out: torch.Tensor, splits: int, d_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV scratch for ``out [T, H, D]``: float32 partial outputs ``[splits, T, H, d_pad]`` and
    running (max, sum) ``[splits, T, H, 2]``; ``out`` twice (not read by the kernel) for one split."""
    if splits <= 1:
        return out, out
    num_tokens, num_heads = out.shape[0], out.shape[1]
    part_acc = torch.empty(splits, num_tokens, num_heads, d_pad, dtype=torch.float32, device=out.device)
    part_ml = torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=out.device)
    return part_acc, part_ml


def _launch_attention(out, part_acc, part_ml, q, k_cache, v_cache, plan, tiles, splits, scale, window, cap):
    """One launch of the attention kernel over (query block, KV head, split) programs."""
    qb_seq, qb_start = plan.query_blocks(tiles.block_q)
    _paged_attention_kernel[(qb_seq.shape[0], k_cache.shape[2], splits)](
        out,
        part_acc,
        part_ml,
        q,
        k_cache,
        v_cache,
        plan.block_tables,
        qb_seq,
        qb_start,
        plan.cu_seqlens_q,
        plan.context_lens,
        q.shape[0],
        splits,
        float(scale),
        float(cap or 1.0),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        plan.block_tables.stride(0),
        G=tiles.group,
        HEAD_DIM=q.shape[2],
        D_PAD=tiles.d_pad,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        PAGE=k_cache.shape[1],
        HAS_WINDOW=window is not None,
        HAS_SOFT_CAP=cap is not None,
        SPLIT=splits > 1,
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
        IEEE=q.dtype == torch.float32,
        KV_FP8=k_cache.dtype == torch.uint8,
    )


def _launch_merge(out, part_acc, part_ml, splits: int, head_dim: int, d_pad: int) -> None:
    """Merge the ``splits`` partial outputs of a split-KV launch into ``out [T, H, D]``."""
    num_tokens, num_heads = out.shape[0], out.shape[1]
    _merge_splits_kernel[(num_tokens, num_heads)](
        out,
        part_acc,
        part_ml,
        num_tokens,
        splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        SPLITS_PAD=triton.next_power_of_2(splits),
    )
