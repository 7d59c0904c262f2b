"""Attention alone: the reference vs the C++ CPU operator, 30 layer calls on the same inputs.

SmolLM2 shapes (9 heads, 3 KV heads, head_dim 64, block 16); cases: 16 decodes at context 260, a fresh
256-token prefill chunk, 64 decodes at context 200 (the offline benchmark's decode pass), a 128-token chunk after 128 cached, 16 decodes + a 112-token chunk. Median of
7 repeats per backend, both in one process. ``python -m benchmarks.cpu_attention_micro``
"""

from __future__ import annotations

import statistics
import time

import torch

from fuseserve.worker.attention import CpuAttentionBackend, TorchAttentionBackend
from fuseserve.worker.ragged_batch import RaggedBatch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = {
    "16 decodes, context 260": [(259, 1)] * 16,
    "64 decodes, context 200": [(199, 1)] * 64,
    "prefill 256, fresh": [(0, 256)],
    "prefill 128 after 128": [(128, 128)],
    "16 decodes + 112-token chunk": [(259, 1)] * 16 + [(100, 112)],
}


def make_pass(seqs: list[tuple[int, int]], dtype: torch.dtype):
    """(batch, q, k, v, k_cache, v_cache) for sequences given as (cached tokens, new tokens)."""
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables, slots, cu, next_block = [], [], [0], 1
    for c, n in seqs:
        blocks = list(range(next_block, next_block + -(-(c + n) // BLOCK)))
        next_block += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
        cu.append(cu[-1] + n)
    width, t = max(len(x) for x in tables), len(slots)
    batch = RaggedBatch(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.zeros(t, dtype=torch.long),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        logits_indices=torch.tensor(cu[1:]) - 1,
        query_lens=[n for _, n in seqs],
        context_lens=[c + n for c, n in seqs],
    )
    q = torch.randn(t, HEADS, HEAD_DIM).to(dtype)
    k, v = torch.randn(t, KV_HEADS, HEAD_DIM).to(dtype), torch.randn(t, KV_HEADS, HEAD_DIM).to(dtype)
    return batch, q, k, v, k_cache, v_cache


def main() -> None:
    for name, seqs in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            batch, q, k, v, kc, vc = make_pass(seqs, dtype)
            median = {}
            for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
                meta = backend.prepare(batch, BLOCK)
                times = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for _ in range(30):
                        backend.forward(q, k, v, kc, vc, meta, HEAD_DIM**-0.5)
                    times.append(time.perf_counter() - t0)
                median[backend.name] = statistics.median(times)
            print(
                f"{name:30s} {str(dtype).split('.')[-1]:9s} 30 layers: torch {median['torch'] * 1e3:7.1f} ms"
                f"  cpu {median['cpu'] * 1e3:7.1f} ms  {median['torch'] / median['cpu']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
