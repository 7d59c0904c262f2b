"""The bf16 prefill-chunk attention of AMX CPUs (kernels/cpu_prefill.cpp, ``cpu_attention.prefill_attention``)
against the reference's per-chunk attention in fp32 on the same bf16 inputs: GQA groups of 1, 3 and 4,
head_dim 64, 128 and 24, fresh chunks and chunks after cached tokens, contexts across several 64-key
blocks, sliding windows, several chunks in one call. On a CPU without oneDNN's bf16 brgemm the same
code runs on cpublas's plain GEMM (the test passes on both)."""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import cpu_attention, reference

BLOCK = 16
CASES = {
    "fresh": [(200, 200), (37, 37)],
    "after_cache": [(100, 250), (40, 1000)],
    "odd": [(33, 97), (129, 129)],
}


def _chunks(specs, num_blocks: int, offset: int, g: torch.Generator) -> list[reference.PrefillChunk]:
    perm = torch.randperm(num_blocks, generator=g)
    chunks, start, used = [], offset, 0
    for q_len, ctx in specs:
        n = -(-ctx // BLOCK)
        chunks.append(
            reference.PrefillChunk(start, start + q_len, perm[used : used + n].to(torch.int32), ctx)
        )
        start, used = start + q_len, used + n
    return chunks


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 64])
def test_prefill_kernel_matches_the_reference(heads, kv_heads, head_dim, case, window):
    g = torch.Generator().manual_seed(0)
    num_blocks = 160
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    chunks = _chunks(CASES[case], num_blocks, 5, g)
    tokens = chunks[-1].end + 3  # rows before and after the chunks: another sequence's, left alone
    # q as a view of a wider [T, (H + 2 KVH) D] projection, as the layers pass it
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    out = torch.full((tokens, heads, head_dim), 7.0, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    cpu_attention.prefill_attention(out, q, k_cache, v_cache, chunks, scale, window)
    f32 = [x.float() for x in (q, k_cache, v_cache)]
    for c in chunks:
        want = reference.prefill_attention(*f32, c, c.mask(window), scale)
        torch.testing.assert_close(out[c.start : c.end].float(), want, atol=1e-2, rtol=1e-2)
    assert (out[: chunks[0].start] == 7.0).all() and (out[chunks[-1].end :] == 7.0).all()


def test_prefill_kernel_refuses_what_it_cannot_read():
    q = torch.zeros(40, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(8, BLOCK, 2, 64, dtype=torch.bfloat16)
    chunk = reference.PrefillChunk(0, 40, torch.arange(3, dtype=torch.int32), 40)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_attention.prefill_attention(torch.empty_like(q), q.float(), cache, cache, [chunk], 0.125)
    with pytest.raises(RuntimeError, match="contiguous caches"):
        strided = torch.zeros(8, BLOCK, 4, 64, dtype=torch.bfloat16)[:, :, :2]
        cpu_attention.prefill_attention(torch.empty_like(q), q, strided, strided, [chunk], 0.125)
    with pytest.raises(RuntimeError, match="does not fit"):
        past = reference.PrefillChunk(20, 60, torch.arange(3, dtype=torch.int32), 40)  # rows past the pass
        cpu_attention.prefill_attention(torch.empty_like(q), q, cache, cache, [past], 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        bad = reference.PrefillChunk(0, 40, torch.tensor([0, 1, 8], dtype=torch.int32), 40)
        cpu_attention.prefill_attention(torch.empty_like(q), q, cache, cache, [bad], 0.125)
