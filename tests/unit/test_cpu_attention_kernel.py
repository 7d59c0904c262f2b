"""The C++ CPU attention operator (``fuseserve.kernels.cpu_attention``) against the PyTorch reference.

Grid: block sizes 16 / 32, GQA ratios 1 / 3, head dims 64 / 128, sliding window off / on, logit
soft-cap off / on, fp32 and bf16 (64 cases). Every pass mixes a fresh prompt longer than the
operator's 16-token query tile, a continued chunk crossing block boundaries, and decodes whose
contexts end inside, at, and just past a block boundary, in scattered non-contiguous blocks.

Tolerances: fp32 ``atol = rtol = 2e-5`` (both accumulate in fp32; the operator's exp is a polynomial
with ~2e-7 relative error). bf16: inputs and outputs are bf16 (one rounding ≈ 4e-3 relative), so
``atol = rtol = 2e-2`` against the reference run in bf16, and ``1e-2`` against the reference run in
fp32 on the same (bf16-valued) inputs, which is the sharper check since the operator accumulates in fp32.
"""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import cpu_attention
from fuseserve.worker.attention import CpuAttentionBackend, TorchAttentionBackend, get_backend
from fuseserve.worker.ragged_batch import RaggedBatch

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler: operator not built")

KV_HEADS = 2


def make_pass(block_size: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A mixed pass over a scattered paged cache: (batch, q, k_new, v_new, k_cache, v_cache)."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    # (tokens already cached, new tokens this pass)
    seqs = [(0, 37), (bs - 3, 9), (2 * bs - 1, 1), (bs, 1), (3 * bs + 4, 1), (0, 1), (bs + 1, 2 * bs)]
    num_blocks = 48
    k_cache = torch.zeros(num_blocks, bs, KV_HEADS, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, positions = [], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [perm.pop() for _ in range(-(-total // bs))]
        tables.append(blocks)
        for p in range(total):
            slot = blocks[p // bs] * bs + p % bs
            if p < cached:  # written by earlier passes
                k_cache.view(-1, KV_HEADS, head_dim)[slot] = torch.randn(KV_HEADS, head_dim, generator=g).to(
                    dtype
                )
                v_cache.view(-1, KV_HEADS, head_dim)[slot] = torch.randn(KV_HEADS, head_dim, generator=g).to(
                    dtype
                )
            else:
                slots.append(slot)
                positions.append(p)
    width = max(len(t) for t in tables)
    t = len(slots)
    cu = [0]
    for _, new in seqs:
        cu.append(cu[-1] + new)
    batch = RaggedBatch(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.tensor(positions),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        logits_indices=torch.tensor([cu[i + 1] - 1 for i in range(len(seqs))]),
        query_lens=[n for _, n in seqs],
        context_lens=[c + n for c, n in seqs],
    )
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, KV_HEADS, head_dim, generator=g).to(dtype)
    v = torch.randn(t, KV_HEADS, head_dim, generator=g).to(dtype)
    return batch, q, k, v, k_cache, v_cache


def run_backend(backend, batch, q, k, v, k_cache, v_cache, block_size, window, cap):
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = backend.prepare(batch, block_size)
    out = backend.forward(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5, sliding_window=window, soft_cap=cap)
    return out, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,cap", [(None, None), (20, None), (None, 30.0), (20, 5.0)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_matches_reference(block_size, gqa, head_dim, window, cap, dtype):
    batch, q, k, v, k_cache, v_cache = make_pass(block_size, KV_HEADS * gqa, head_dim, dtype)
    args = (batch, q, k, v, k_cache, v_cache, block_size, window, cap)
    got, kc, vc = run_backend(CpuAttentionBackend(), *args)
    want, kr, vr = run_backend(TorchAttentionBackend(), *args)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the KV write is the reference's
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # sharper: the reference in fp32 on the same bf16-valued inputs
        f32 = [x.float() for x in (q, k, v, k_cache, v_cache)]
        want32, _, _ = run_backend(TorchAttentionBackend(), batch, *f32, block_size, window, cap)
        torch.testing.assert_close(got.float(), want32, atol=1e-2, rtol=1e-2)


def test_cpu_kernel_decode_only_and_single_prefill():
    """Passes of only decodes and of only one prompt chunk (the two shapes the engine runs most)."""
    for seed in range(3):
        batch, q, k, v, k_cache, v_cache = make_pass(16, 6, 64, torch.float32, seed)
        keep = [i for i, n in enumerate(batch.query_lens) if n == 1]
        for rows in (keep, [0]):
            sub = _subset(batch, rows)
            tok = torch.cat([torch.arange(batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]) for i in rows])
            args = (sub, q[tok], k[tok], v[tok], k_cache, v_cache, 16, None, None)
            got, _, _ = run_backend(CpuAttentionBackend(), *args)
            want, _, _ = run_backend(TorchAttentionBackend(), *args)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("num_decodes", [3, 12])
@pytest.mark.parametrize("window,cap", [(None, None), (20, 5.0)], ids=str)
def test_cpu_kernel_decode_paths(num_decodes, window, cap, dtype):
    """Decode passes on one thread: 12 decodes take the path that reads every KV head of a cache row
    together, 3 decodes one head per work item (fewer items than 4 per thread); fp16 takes the
    element-by-element path. Contexts from 1 to 150 keys, ending inside and at block boundaries."""
    block_size, gqa, head_dim = 16, 3, 64
    g = torch.Generator().manual_seed(num_decodes)
    contexts = [1, 16, 17, 31, 64, 150, 100, 47, 33, 2, 120, 80][:num_decodes]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 4
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // block_size))] for c in contexts]
    width = max(len(t) for t in tables)
    n = len(contexts)
    batch = RaggedBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.tensor([c - 1 for c in contexts]),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(
            [
                t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                for t, c in zip(tables, contexts, strict=True)
            ]
        ),
        logits_indices=torch.arange(n),
        query_lens=[1] * n,
        context_lens=contexts,
    )
    q = torch.randn(n, KV_HEADS * gqa, head_dim, generator=g).to(dtype)
    k = torch.randn(n, KV_HEADS, head_dim, generator=g).to(dtype)
    v = torch.randn(n, KV_HEADS, head_dim, generator=g).to(dtype)
    args = (batch, q, k, v, k_cache, v_cache, block_size, window, cap)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got, _, _ = run_backend(CpuAttentionBackend(), *args)
    finally:
        torch.set_num_threads(threads)
    f32 = [x.float() for x in (q, k, v, k_cache, v_cache)]
    want, _, _ = run_backend(TorchAttentionBackend(), batch, *f32, block_size, window, cap)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _subset(batch: RaggedBatch, rows: list[int]) -> RaggedBatch:
    qlens = [batch.query_lens[i] for i in rows]
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    tok = torch.cat([torch.arange(batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]) for i in rows])
    return RaggedBatch(
        input_ids=batch.input_ids[tok],
        positions=batch.positions[tok],
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=batch.seq_lens[rows],
        block_tables=batch.block_tables[rows],
        slot_mapping=batch.slot_mapping[tok],
        logits_indices=torch.tensor(cu[1:]) - 1,
        query_lens=qlens,
        context_lens=[batch.context_lens[i] for i in rows],
    )


def test_cpu_kernel_is_the_auto_backend_on_cpu():
    assert get_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_backend("cpu").name == "cpu"
    assert get_backend("torch").name == "torch"


def test_cpu_kernel_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    """No cached build and no compiler: ``load`` says what to install; ``auto`` falls back to torch."""
    monkeypatch.setenv("FUSESERVE_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    cpu_attention.load.cache_clear()
    try:
        with pytest.raises(cpu_attention.CpuKernelUnavailable, match="no C\\+\\+ compiler"):
            cpu_attention.load()
        assert get_backend("auto", torch.device("cpu")).name == "torch"
    finally:
        cpu_attention.load.cache_clear()


@pytest.mark.parametrize("order", ["decodes_first", "mixed", "only_long"])
@pytest.mark.parametrize("window", [None, 20])
def test_long_prefill_chunks_to_the_prefill_kernel(monkeypatch, order, window):
    """Where ``amx_prefill()`` holds (AMX), bf16 chunks of ``PREFILL_MIN_TOKENS`` or more go to ``prefill_attention`` and
    the rest of the pass to the operator: the same output as the operator alone, whether the operator's
    tokens come first (a slice), are interleaved with the long chunks (a gather), or are none."""
    batch, q, k, v, k_cache, v_cache = make_pass(16, 6, 64, torch.bfloat16)
    long = [i for i, n in enumerate(batch.query_lens) if n >= cpu_attention.PREFILL_MIN_TOKENS]
    short = [i for i in range(len(batch.query_lens)) if i not in long]
    rows = {"decodes_first": short + long, "mixed": list(range(len(batch.query_lens))), "only_long": long}[
        order
    ]
    sub = _subset(batch, rows)
    tok = torch.cat([torch.arange(batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]) for i in rows])
    args = (sub, q[tok], k[tok], v[tok], k_cache, v_cache, 16, window, None)
    monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: True)
    meta = CpuAttentionBackend().prepare(sub, 16)
    assert meta.split is not None and len(meta.split.prefills) == len(long)
    assert (meta.split.rest is None) == (order == "only_long")
    assert meta.split.prefix == (order == "decodes_first")
    got, kc, _ = run_backend(CpuAttentionBackend(), *args)
    monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: False)
    assert CpuAttentionBackend().prepare(sub, 16).split is None
    want, kw, _ = run_backend(CpuAttentionBackend(), *args)
    assert torch.equal(kc, kw)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    f32 = [x.float() for x in (q[tok], k[tok], v[tok], k_cache, v_cache)]
    want32, _, _ = run_backend(TorchAttentionBackend(), sub, *f32, 16, window, None)
    torch.testing.assert_close(got.float(), want32, atol=1e-2, rtol=1e-2)


def test_build_cache_key_covers_the_shared_header(tmp_path):
    """An edit to a header beside a source (cpu_vec.h) is a new build, not the stale cached library."""
    from fuseserve.kernels.cpu_build import library_path

    source, header = tmp_path / "op.cpp", tmp_path / "cpu_vec.h"
    source.write_text('#include "cpu_vec.h"\n')
    header.write_text("// one\n")
    before = library_path(source, "c++")
    header.write_text("// two\n")
    assert library_path(source, "c++") != before
