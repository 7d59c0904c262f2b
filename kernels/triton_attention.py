"""Triton paged ragged attention and KV-cache write: one launch per layer for a whole SplitFuse pass.

A pass mixes prefill chunks (many query tokens, attending causally to themselves and to the earlier
chunks of their sequence through the block table) and decode tokens (one query each). The attention
kernel tiles the queries of each sequence into *query blocks* of ``BLOCK_Q`` tokens and runs one
program per (query block, KV head): its ``BLOCK_M = BLOCK_Q * G`` rows are the ``G`` query heads
that share the KV head (GQA) for each token, so every K/V tile is loaded once for the whole group.
The program walks the sequence's keys tile by tile (``BLOCK_N`` keys, gathered through the block
table), masks causally (and by the sliding window), optionally soft-caps the scores, and keeps an
online softmax (FlashAttention-2, Dao 2023, algorithm 1).

Split-KV ("flash-decoding", Dao et al. 2023): when the grid is too small to fill the GPU and
contexts are long, a third grid axis splits each query block's key range into ``num_splits`` parts
that run in parallel; each writes its unnormalised output with its running max and sum, and a
second small kernel merges them (log-sum-exp rescaling).

Shapes follow ``fuseserve.kernels.reference``: ``q [T, H, D]``, ``k/v [T, KVH, D]``, caches
``[num_blocks, block_size, KVH, D]``; visibility and soft-cap semantics are the reference's.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). Triton
decides this when it is first imported, and torch imports it as soon as ``transformers`` loads a
model, so a CPU process that wants these kernels must start with ``TRITON_INTERPRET=1`` in its
environment (the test suite's conftest sets it); this module sets it only if triton is not loaded yet
and the variable is unset (``TRITON_INTERPRET=0`` keeps compiled kernels, e.g. to compile for a GPU
target without one). The interpreter cannot multiply bfloat16
operands (it keeps them as raw 16-bit integers), so there bfloat16 tiles are widened to float32
before ``tl.dot``; compiled kernels use the tensor cores in the input dtype.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    # the interpreter is chosen when a function is decorated, triton's own library functions included
    if "triton" in sys.modules:
        raise ImportError(
            "no CUDA device: Triton kernels can only run interpreted, but triton was imported (by torch, "
            "when transformers loads a model) before TRITON_INTERPRET=1 was set; start the process "
            "with TRITON_INTERPRET=1 in its environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# globals read inside kernels must be constexpr (compiled Triton rejects plain Python globals)
LOG2E = tl.constexpr(1.4426950408889634)
MASKED = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: fully masked rows stay NaN-free


# ----------------------------------------------------------------------------------------------
# KV-cache write
# ----------------------------------------------------------------------------------------------


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
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # KVH * HEAD_DIM
    ROW_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
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
    tl.store(k_cache_ptr + (blk * stride_cb + off * stride_cs)[:, None] + col[None, :], k, mask=ok)
    tl.store(v_cache_ptr + (blk * stride_vcb + off * stride_vcs)[:, None] + col[None, :], v, mask=ok)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, KVH, D]`` at flat slots ``slot_mapping [T]`` of the caches (in place).

    Same result as ``reference.write_kv`` (``index_copy_`` into the slots); a negative slot skips
    its token. The caches must be ``[num_blocks, block_size, KVH, D]`` with each slot's ``[KVH, D]``
    contiguous; ``k``/``v`` need a contiguous last dimension.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    kvh, d = k.shape[1], k.shape[2]
    _check_cache(k_cache, kvh, d)
    _check_cache(v_cache, kvh, d)
    k, v = _last_contiguous(k), _last_contiguous(v)
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
        HEAD_DIM=d,
        ROW=kvh * d,
        ROW_PAD=triton.next_power_of_2(kvh * d),
        PAGE=k_cache.shape[1],
        BLOCK_T=block_t,
    )


def _check_cache(cache: torch.Tensor, kvh: int, d: int) -> None:
    if cache.dim() != 4 or cache.shape[2:] != (kvh, d) or cache.stride(2) != d or cache.stride(3) != 1:
        raise ValueError(
            f"KV cache must be [num_blocks, block_size, {kvh}, {d}] with contiguous slots; "
            f"got shape {tuple(cache.shape)} strides {cache.stride()}"
        )


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------
# Paged ragged attention
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1, written with exp so that it runs in the interpreter as well
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_acc_ptr,  # [num_splits, T, H, D_PAD] float32 (split-KV only)
    part_ml_ptr,  # [num_splits, T, H, 2] float32: running max (log2 units) and sum (split-KV only)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    qb_seq_ptr,  # [NQB] sequence of each query block
    qb_start_ptr,  # [NQB] first token of each query block, counted within its chunk
    cu_q_ptr,  # [S + 1] prefix sums of the chunks' lengths
    ctx_ptr,  # [S] context length of each sequence after this pass
    num_tokens,
    num_splits,
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    G: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    H = G * tl.num_programs(1)

    seq = tl.load(qb_seq_ptr + qb)
    q_off = tl.load(qb_start_ptr + qb)
    t0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - t0
    ctx = tl.load(ctx_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // G  # token within the chunk
    head = kv_head * G + rows % G
    row_ok = (tok < q_len) & (rows < BLOCK_Q * G)
    q_pos = ctx - q_len + tok  # position of each row's token in its sequence
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t_idx = (t0 + tok).to(tl.int64)

    q = tl.load(
        q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # keys this query block can see: [lo, hi)
    first_pos = ctx - q_len + q_off
    hi = tl.minimum(first_pos + BLOCK_Q, ctx)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(hi, BLOCK_N)
    if SPLIT:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        blk = tl.load(table + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
        in_page = k_pos % PAGE
        k_t = tl.load(
            k_cache_ptr + (blk * stride_kb + in_page * stride_ks + kv_head * stride_kh)[None, :] + d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [D_PAD, BLOCK_N]
        v = tl.load(
            v_cache_ptr + (blk * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        if UPCAST:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        s = s * scale
        if HAS_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        row = (split * num_tokens + t_idx) * H + head
        ok = row_ok[:, None] & (d < D_PAD)[None, :]
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=ok)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_tokens,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, D_PAD)
    row = (sp * num_tokens + t) * H + h
    m = tl.load(part_ml_ptr + row * 2, mask=sp_ok, other=MASKED)
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass
class TritonAttentionPlan:
    """Per-pass tensors of one ragged batch, built once by ``plan_attention`` and reused by every layer.

    slot_mapping: ``[T]`` int64 KV slot of each token. cu_seqlens_q: ``[S+1]`` int32.
    context_lens: ``[S]`` int32 context length of each sequence after this pass.
    block_tables: ``[S, max_blocks]`` int32. query_lens: the chunk lengths (host list).
    num_splits: split-KV parts (None: chosen per launch from the grid size and the longest context).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    max_context_len: int
    block_size: int
    num_splits: int | None = None
    _query_blocks: dict = field(default_factory=dict)  # BLOCK_Q → (qb_seq, qb_start)

    def query_blocks(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qb_seq, qb_start)`` ``[NQB]`` int32: sequence and in-chunk start of each query block."""
        if block_q not in self._query_blocks:
            seq, start = [], []
            for i, q_len in enumerate(self.query_lens):
                for s in range(0, q_len, block_q):
                    seq.append(i)
                    start.append(s)
            dev = self.slot_mapping.device
            self._query_blocks[block_q] = (
                torch.tensor(seq, dtype=torch.int32, device=dev),
                torch.tensor(start, dtype=torch.int32, device=dev),
            )
        return self._query_blocks[block_q]


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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over each sequence's cached keys/values → ``[T, H, D]``, one launch
    (two with split-KV).

    The pass's own K/V must already be in the cache (``write_kv``). ``sliding_window`` W: a query at
    position p sees keys at positions ``> p - W``; ``soft_cap`` c: scores become ``c * tanh(s / c)``.
    """
    num_tokens, num_heads, head_dim = q.shape
    kvh = k_cache.shape[2]
    if num_heads % kvh:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kvh} KV heads")
    _check_cache(k_cache, kvh, head_dim)
    _check_cache(v_cache, kvh, head_dim)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    q = _last_contiguous(q)
    group = num_heads // kvh
    block_m = max(16, triton.next_power_of_2(group))
    if max(plan.query_lens) > 1:
        block_m = max(block_m, 64 if not INTERPRETED else 32)
    block_q = block_m // group
    qb_seq, qb_start = plan.query_blocks(block_q)
    page = k_cache.shape[1]
    block_n = max(page, 16) if INTERPRETED else max(page, 32)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    num_programs = qb_seq.shape[0] * kvh
    splits = plan.num_splits or choose_num_splits(num_programs, plan.max_context_len, block_n, q.device)
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens, num_heads, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[(qb_seq.shape[0], kvh, splits)](
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
        num_tokens,
        splits,
        float(scale),
        float(soft_cap or 1.0),
        int(sliding_window or 0),
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
        G=group,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE=page,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=soft_cap is not None,
        SPLIT=splits > 1,
        UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
        IEEE=q.dtype == torch.float32,
    )
    if splits > 1:
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
    return out
