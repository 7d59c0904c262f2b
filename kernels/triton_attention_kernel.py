"""The Triton paged ragged attention kernel and the split-KV merge kernel (launched by ``triton_attention``).

A pass mixes prefill chunks (many query tokens, attending causally to themselves and to the earlier
chunks of their sequence through the block table) and decode tokens (one query each). The attention
kernel tiles the queries of each sequence into *query blocks* of ``BLOCK_Q`` tokens and runs one
program per (query block, KV head): its ``BLOCK_M = BLOCK_Q * G`` rows are the ``G`` query heads
that share the KV head (GQA) for each token, so every K/V tile is loaded once for the whole group.
The program walks the sequence's keys tile by tile (``BLOCK_N`` keys, gathered through the block
table), masks causally (and by the sliding window), optionally soft-caps the scores, and keeps an
online softmax (FlashAttention-2, Dao 2023, algorithm 1).

Split-KV ("flash-decoding", Dao et al. 2023): a third grid axis splits each query block's key range
into ``num_splits`` parts that run in parallel; each writes its unnormalised output with its running
max and sum, and ``_merge_splits_kernel`` merges them (log-sum-exp rescaling).

The kernel reads as calls on small ``@triton.jit`` helpers (the query block, its query tile, its key
range, a K/V tile, its scores, one online-softmax step, the store); Triton inlines them.
"""

from __future__ import annotations

from fuseserve.kernels.triton_fp8 import fp8_decode
from fuseserve.kernels.triton_runtime import tl, triton

# globals read inside kernels must be constexpr (compiled Triton rejects plain Python globals)
LOG2E = tl.constexpr(1.4426950408889634)
MASKED = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: fully masked rows stay NaN-free


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1, written with exp so that it runs in the interpreter as well
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: full float32 products (no TF32) for float32 inputs
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _query_block(qb, qb_seq_ptr, qb_start_ptr, cu_q_ptr, ctx_ptr):
    # query block qb: its sequence seq, its first token q_off counted within the chunk, the chunk's
    # first token t0 in the pass and its length q_len, the sequence's context length ctx after this pass
    seq = tl.load(qb_seq_ptr + qb)
    q_off = tl.load(qb_start_ptr + qb)
    t0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - t0
    ctx = tl.load(ctx_ptr + seq)
    return seq, q_off, t0, q_len, ctx


@triton.jit
def _load_query(q_ptr, t_idx, head, d, row_ok, d_ok, stride_qt, stride_qh, UPCAST: tl.constexpr):
    # [BLOCK_M, D_PAD]: row r is token t_idx[r], head head[r]; rows and columns past the end read 0
    q = tl.load(
        q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _key_tiles(
    first_pos,
    ctx,
    window,
    split,
    num_splits,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # (tile_lo, tile_hi, hi): the key tiles this program walks and the end of the keys its block sees,
    # [lo, hi) for the query block whose first token is at first_pos; with split-KV, this split's share
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
    return tile_lo, tile_hi, hi


@triton.jit
def _load_key_tile(k_cache_ptr, slot, k_ok, d, d_ok, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    # [D_PAD, BLOCK_N], transposed for Q @ K^T; slot: [BLOCK_N] offset of each key's row in the cache
    k_t = tl.load(k_cache_ptr + slot[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    if KV_FP8:  # raw e4m3 bytes → float32
        k_t = fp8_decode(k_t)
    elif UPCAST:
        k_t = k_t.to(tl.float32)
    return k_t


@triton.jit
def _load_value_tile(v_cache_ptr, slot, k_ok, d, d_ok, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    # [BLOCK_N, D_PAD]; slot: [BLOCK_N] offset of each value's row in the cache
    v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_FP8:  # raw e4m3 bytes → float32
        v = fp8_decode(v)
    elif UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _widen_fp8(k_t, v, q, KV_FP8: tl.constexpr):
    # decoded fp8 tiles in q's dtype (stored values: the host folds the scales into scale and output)
    if KV_FP8:
        k_t = k_t.to(q.dtype)
        v = v.to(q.dtype)
    return k_t, v


@triton.jit
def _scores(
    q,
    k_t,
    k_pos,
    k_ok,
    q_pos,
    scale,
    soft_cap,
    window,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    # [BLOCK_M, BLOCK_N] scaled (and soft-capped) scores in log2 units; keys a row cannot see are -inf
    s = _dot(q, k_t, IEEE)
    s = s * scale
    if HAS_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    return tl.where(visible, s * LOG2E, float("-inf"))


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    # FlashAttention-2's update for one key tile: the running max m_i, sum l_i and output acc are
    # rescaled to the new max, then this tile's probabilities and P @ V are added
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = _dot(p.to(v.dtype), v, IEEE)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _store_partials(part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, d, row_ok, D_PAD: tl.constexpr):
    # split-KV: this split's unnormalised output and its running max and sum, for _merge_splits_kernel
    ok = row_ok[:, None] & (d < D_PAD)[None, :]
    tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=ok)
    tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _store_output(out_ptr, acc, l_i, t_idx, head, d, row_ok, d_ok, stride_ot, stride_oh):
    # one split: the normalised output (rows that saw no key keep 0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] (one split)
    part_acc_ptr, part_ml_ptr,  # split-KV only, float32: [num_splits, T, H, D_PAD], [num_splits, T, H, 2]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    qb_seq_ptr, qb_start_ptr,  # [NQB] sequence, and first token within its chunk, of each query block
    cu_q_ptr, ctx_ptr,  # [S + 1] prefix sums of the chunks' lengths; [S] context lengths after this pass
    num_tokens, num_splits, scale, soft_cap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,  # uint8 views of fp8 caches: tiles decoded (scales applied by the host)
):  # fmt: skip
    # one program: the BLOCK_M rows (BLOCK_Q tokens x G heads) of query block qb for KV head kv_head,
    # over the key tiles of split-KV part split (all of them without split-KV)
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    H = G * tl.num_programs(1)
    seq, q_off, t0, q_len, ctx = _query_block(qb, qb_seq_ptr, qb_start_ptr, cu_q_ptr, ctx_ptr)

    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // G  # token within the chunk
    head = kv_head * G + rows % G
    row_ok = (tok < q_len) & (rows < BLOCK_Q * G)
    q_pos = ctx - q_len + tok  # position of each row's token in its sequence
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t_idx = (t0 + tok).to(tl.int64)
    q = _load_query(q_ptr, t_idx, head, d, row_ok, d_ok, stride_qt, stride_qh, UPCAST)
    first_pos = ctx - q_len + q_off
    tile_lo, tile_hi, hi = _key_tiles(
        first_pos, ctx, window, split, num_splits, BLOCK_Q, BLOCK_N, HAS_WINDOW, SPLIT
    )

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        blk = tl.load(table + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
        in_page = k_pos % PAGE
        k_slot = blk * stride_kb + in_page * stride_ks + kv_head * stride_kh  # [BLOCK_N] cache row offsets
        k_t = _load_key_tile(k_cache_ptr, k_slot, k_ok, d, d_ok, UPCAST, KV_FP8)
        v_slot = blk * stride_vb + in_page * stride_vs + kv_head * stride_vh
        v = _load_value_tile(v_cache_ptr, v_slot, k_ok, d, d_ok, UPCAST, KV_FP8)
        k_t, v = _widen_fp8(k_t, v, q, KV_FP8)
        s = _scores(q, k_t, k_pos, k_ok, q_pos, scale, soft_cap, window, HAS_SOFT_CAP, HAS_WINDOW, IEEE)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)

    if SPLIT:
        row = (split * num_tokens + t_idx) * H + head
        _store_partials(part_acc_ptr, part_ml_ptr, row, acc, m_i, l_i, d, row_ok, D_PAD)
    else:
        _store_output(out_ptr, acc, l_i, t_idx, head, d, row_ok, d_ok, stride_ot, stride_oh)


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
