"""Triton paged ragged attention and KV-cache write against the PyTorch reference (``kernels/reference.py``).

Each pass mixes prefill chunks (a fresh prompt and a chunk continuing earlier KV) with decode tokens,
and its contexts cross block boundaries. The grid covers block sizes 16 and 32, GQA ratios 1 and 3,
head dims 64 and 128, sliding window on and off, soft-cap, the split-KV path, and fp32/fp16/bf16.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by the kernel
module when no CUDA device is visible); with one they compile and run on it. The oracle is the
reference computed in float32 from the same (rounded) inputs; tolerances per dtype are in ``TOL``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from fuseserve.kernels import reference  # noqa: E402
from fuseserve.kernels import triton_attention as tri  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# max |triton - reference(fp32)| allowed, as (atol, rtol) for torch.testing.assert_close.
# fp16/bf16: the output is rounded to the dtype (bf16 keeps 8 bits) and the probabilities are rounded
# to it before the P @ V product, as on tensor cores.
TOL = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (3e-2, 2e-2),
}

# (tokens already cached, new tokens this pass) per sequence: a fresh prompt, a chunk continuing
# earlier KV across a block boundary, and decodes whose contexts end just past / exactly on / inside blocks.
MIXED = [(0, 21), (29, 9), (47, 1), (15, 1), (70, 1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_pass(seqs, page, kv_heads, group, head_dim, dtype, seed=0):
    """Random caches holding each sequence's earlier K/V in scattered blocks, and this pass's inputs."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // page) for c, n in seqs) + 3
    k_cache = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, k_new, v_new = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // page))]
        tables.append(blocks)
        k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor([blocks[p // page] * page + p % page for p in range(total)])
        flat_k[seq_slots[:cached]] = k[:cached]
        flat_v[seq_slots[:cached]] = v[:cached]
        slots.append(seq_slots[cached:])
        k_new.append(k[cached:])
        v_new.append(v[cached:])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [n for _, n in seqs]
    context_lens = [c + n for c, n in seqs]
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g).to(dtype)
    to = lambda x: x.to(DEVICE)
    return dict(
        q=to(q),
        k=to(torch.cat(k_new)),
        v=to(torch.cat(v_new)),
        k_cache=to(k_cache),
        v_cache=to(v_cache),
        block_tables=to(block_tables),
        slot_mapping=to(torch.cat(slots)),
        query_lens=query_lens,
        context_lens=context_lens,
        cu_seqlens_q=to(torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)),
        seq_lens=to(torch.tensor(context_lens, dtype=torch.int32)),
        page=page,
    )


def run_reference(p, window, cap, scale):
    """Reference output in float32 from the same inputs; writes the pass's K/V into float32 copies."""
    k_cache, v_cache = p["k_cache"].float().clone(), p["v_cache"].float().clone()
    plan = reference.plan_attention(
        p["query_lens"], p["context_lens"], p["block_tables"], p["slot_mapping"], p["page"]
    )
    reference.write_kv(k_cache, v_cache, p["k"].float(), p["v"].float(), plan.slot_mapping)
    return reference.paged_attention(p["q"].float(), k_cache, v_cache, plan, scale, window, cap)


def triton_pass(p, num_splits=None):
    """The Triton plan of pass ``p`` and copies of its caches with the pass's K/V written by the kernel."""
    keys = ("query_lens", "context_lens", "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "page")
    plan = tri.plan_attention(*(p[k] for k in keys), num_splits=num_splits)
    k_cache, v_cache = p["k_cache"].clone(), p["v_cache"].clone()
    tri.write_kv(k_cache, v_cache, p["k"], p["v"], plan.slot_mapping)
    return plan, k_cache, v_cache


def run_triton(p, window, cap, scale, num_splits=None):
    plan, k_cache, v_cache = triton_pass(p, num_splits)
    return tri.paged_attention(p["q"], k_cache, v_cache, plan, scale, window, cap)


# The core grid: block size x GQA ratio x head dim x window, 16 cases; dtype and soft-cap rotate
# through them so each dtype meets each setting.
GRID = [
    pytest.param(page, group, dim, window, DTYPES[i % 3], 30.0 if i % 4 == 3 else None, id=f"{i:02d}")
    for i, (page, group, dim, window) in enumerate(itertools.product((16, 32), (1, 3), (64, 128), (None, 20)))
]


@pytest.mark.parametrize("page,group,dim,window,dtype,cap", GRID)
def test_triton_attention_mixed_pass(page, group, dim, window, dtype, cap):
    p = make_pass(MIXED, page, 2, group, dim, dtype)
    scale = dim**-0.5
    want = run_reference(p, window, cap, scale)
    got = run_triton(p, window, cap, scale)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "seqs,page,group,window,cap,splits,dtype",
    [
        pytest.param([(40, 1), (95, 1), (7, 1)], 16, 3, None, None, 3, torch.float32, id="split-decode"),
        pytest.param(MIXED, 32, 1, 13, 5.0, 2, torch.float16, id="split-mixed-window-cap"),
        pytest.param([(100, 1), (3, 1)], 16, 1, None, None, 4, torch.bfloat16, id="split-more-than-tiles"),
        pytest.param(
            [(40, 1), (95, 1), (7, 1), (64, 1)], 32, 3, 33, None, None, torch.float16, id="decode-only"
        ),
        pytest.param([(0, 37), (16, 16)], 16, 3, None, 2.0, None, torch.float32, id="prefill-only-cap"),
        pytest.param([(0, 5), (3, 2)], 16, 1, 1, None, None, torch.float32, id="window-1"),
    ],
)
def test_triton_attention_special_passes(seqs, page, group, window, cap, splits, dtype):
    p = make_pass(seqs, page, 2, group, 64, dtype, seed=1)
    want = run_reference(p, window, cap, 0.125)
    got = run_triton(p, window, cap, 0.125, num_splits=splits)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_triton_attention_head_dim_not_power_of_two():
    p = make_pass(MIXED[:3], 16, 1, 3, 80, torch.float32, seed=2)
    torch.testing.assert_close(run_triton(p, None, None, 0.1), run_reference(p, None, None, 0.1), **_tol32())


def test_triton_attention_one_plan_serves_layers_with_different_windows():
    """Gemma 2 alternates windowed and global layers: the same plan, two calls, two right answers."""
    p = make_pass(MIXED, 16, 2, 3, 64, torch.float32, seed=3)
    plan, k_cache, v_cache = triton_pass(p)
    for window, cap in ((10, 50.0), (None, None)):
        got = tri.paged_attention(p["q"], k_cache, v_cache, plan, 0.125, window, cap)
        torch.testing.assert_close(got, run_reference(p, window, cap, 0.125), **_tol32())


def _tol32():
    atol, rtol = TOL[torch.float32]
    return dict(atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "page,kv_heads,dim,dtype", [(16, 3, 64, torch.float32), (32, 1, 128, torch.bfloat16)]
)
def test_triton_kv_write_kernel_equals_index_copy(page, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(4)
    num_blocks, tokens = 9, 37
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, page, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    # k/v as column slices of one fused qkv projection (non-contiguous rows), as models produce them
    qkv = torch.randn(tokens, 3, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * page, generator=g)[:tokens].to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, kv_heads, dim).index_copy_(0, slots, k)
    want_v.view(-1, kv_heads, dim).index_copy_(0, slots, v)
    tri.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_triton_kv_write_kernel_skips_negative_slots():
    k_cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 64, device=DEVICE)
    tri.write_kv(k_cache, v_cache, k, 2 * k, torch.tensor([5, -1, 20], device=DEVICE))
    flat_k, flat_v = k_cache.view(-1, 64), v_cache.view(-1, 64)
    assert flat_k[[5, 20]].eq(1).all() and flat_v[[5, 20]].eq(2).all()
    assert flat_k.sum() == 2 * 64 and flat_v.sum() == 4 * 64


def test_triton_backend_through_the_attention_interface():
    """``get_backend("triton")`` behind ``AttentionBackend``: the same output as ``torch``."""
    from fuseserve.worker.attention import get_backend
    from fuseserve.worker.ragged_batch import RaggedBatch

    p = make_pass(MIXED, 16, 2, 3, 64, torch.float32, seed=5)
    batch = RaggedBatch(
        input_ids=torch.zeros(p["q"].shape[0], dtype=torch.long, device=DEVICE),
        positions=torch.zeros(p["q"].shape[0], dtype=torch.long, device=DEVICE),
        cu_seqlens_q=p["cu_seqlens_q"],
        seq_lens=p["seq_lens"],
        block_tables=p["block_tables"],
        slot_mapping=p["slot_mapping"],
        logits_indices=torch.zeros(0, dtype=torch.long, device=DEVICE),
        query_lens=p["query_lens"],
        context_lens=p["context_lens"],
    )
    outs = []
    for name in ("torch", "triton"):
        backend = get_backend(name, DEVICE)
        assert backend.name == name
        k_cache, v_cache = p["k_cache"].clone(), p["v_cache"].clone()
        meta = backend.prepare(batch, 16)
        outs.append(backend.forward(p["q"], p["k"], p["v"], k_cache, v_cache, meta, 0.125, 20, 30.0))
        assert outs[-1].shape == (p["q"].shape[0], p["q"].shape[1] * 64)
    torch.testing.assert_close(outs[1], outs[0], **_tol32())
