"""The PyTorch reference paged attention against dense per-sequence attention written out by hand.

One pass mixes prefill chunks (with and without earlier context) and decode tokens; each layer may
use its own sliding window and logit soft-cap (Gemma 2 alternates windowed and global layers).
"""

from __future__ import annotations

import math

import pytest
import torch

from fuseserve.kernels import reference

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def dense(q, k, v, q_pos, scale, window, cap):
    """``q [q, H, D]`` at positions ``q_pos`` over ``k/v [L, KVH, D]`` (positions 0..L-1) → ``[q, H, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 30.0), (3, 2.0)])
def test_mixed_pass_matches_dense(window, cap):
    torch.manual_seed(0)
    # (context already cached, new tokens this pass): a fresh prompt, a continued chunk, two decodes
    seqs = [(0, 7), (6, 5), (9, 1), (2, 1)]
    num_blocks = 32
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, slots, full_k, full_v = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [perm.pop() for _ in range(-(-total // BLOCK))]
        tables.append(blocks)
        full_k.append(torch.randn(total, KV_HEADS, DIM))
        full_v.append(torch.randn(total, KV_HEADS, DIM))
        for p in range(total):
            slot = blocks[p // BLOCK] * BLOCK + p % BLOCK
            if p < cached:  # earlier passes wrote these
                k_cache.view(-1, KV_HEADS, DIM)[slot] = full_k[-1][p]
                v_cache.view(-1, KV_HEADS, DIM)[slot] = full_v[-1][p]
            else:
                slots.append(slot)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(n for _, n in seqs), HEADS, DIM)
    k_new = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, seqs, strict=True)])
    v_new = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, seqs, strict=True)])

    plan = reference.plan_attention(
        [n for _, n in seqs], [c + n for c, n in seqs], block_tables, torch.tensor(slots), BLOCK
    )
    reference.write_kv(k_cache, v_cache, k_new, v_new, plan.slot_mapping)
    scale = DIM**-0.5
    out = reference.paged_attention(q, k_cache, v_cache, plan, scale, window, cap)
    # the same plan serves another layer with other settings (masks are built per window)
    reference.paged_attention(q, k_cache, v_cache, plan, scale, None, None)

    start = 0
    for (cached, new), fk, fv in zip(seqs, full_k, full_v, strict=True):
        want = dense(q[start : start + new], fk, fv, torch.arange(cached, cached + new), scale, window, cap)
        torch.testing.assert_close(out[start : start + new], want, atol=1e-5, rtol=1e-5)
        start += new
