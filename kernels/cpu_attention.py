"""CPU paged ragged attention: a C++ operator compiled at first use, and its attention backend.

``cpu_attention.cpp`` attends every query of a SplitFuse pass (prefill chunks and decode tokens, one
call) to its keys where they lie in the paged cache: it walks each sequence's block table, widens one
block of K/V at a time to fp32, and keeps flash-attention's running max and sum (online softmax) for
a prefill tile; decode rows read every KV head of a cache row together and take their softmax in two
passes over the keys (the source's header says how). Nothing is gathered or copied per layer. The reference (``kernels/reference.py``) copies each
sequence's whole K/V out of the cache per layer and loops over prefill chunks in Python.

Build: at first use, by ``cpu_build`` (``c++ -O3 -march=native -fopenmp`` against torch's headers,
cached in ``~/.cache/fuseserve/extensions/`` under a hash of the source, flags, torch and CPU; about
30-60 s on 2 cores, once). Without a compiler ``load()`` raises ``CpuKernelUnavailable`` with the
reason; ``get_backend("auto")`` then falls back to the reference and says so once.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from fuseserve.kernels import cpu_build, kv_quant, reference
from fuseserve.kernels.cpu_build import CpuKernelUnavailable

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
OP_NAMESPACE = "fuseserve_cpu"
__all__ = ["CpuKernelUnavailable", "available", "load", "paged_attention", "plan", "write_and_attend"]


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_cpu``, building the library first if no cached build exists (``cpu_build``).

    Raises ``CpuKernelUnavailable`` when no C++ compiler is on PATH or the build fails.
    """
    return cpu_build.load(SOURCE, OP_NAMESPACE)


def available() -> bool:
    """Whether the operator builds and loads here (the first call may compile it)."""
    try:
        load()
    except CpuKernelUnavailable:
        return False
    return True


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over the paged caches ``[num_blocks, block_size, KVH, D]`` → ``[T, H, D]``.

    ``cu_seqlens_q [S+1]``, ``seq_lens [S]`` (context length after this pass) and ``block_tables
    [S, max_blocks]`` are the ragged batch's int32 tensors; the pass's K/V must already be written.
    Same semantics as ``reference.paged_attention`` (window and soft-cap per call); fp32 accumulation.
    Caches in ``q``'s dtype, or fp8 (``kv_quant``) read with ``k_scale`` / ``v_scale``.
    """
    fp8 = kv_quant.is_fp8(k_cache)
    if fp8:
        scale = scale * k_scale
    out = torch.empty_like(q)
    load().paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        float(scale),
        int(sliding_window or 0),
        float(soft_cap or 0.0),
    )
    if fp8 and v_scale != 1.0:
        out.mul_(v_scale)
    return out


class CpuAttentionMetadata:
    """Per-pass inputs of the C++ operator: the batch's own int32 tensors, made contiguous once."""

    def __init__(self, slot_mapping, block_tables, cu_seqlens_q, seq_lens):
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()


def plan(batch: Any) -> CpuAttentionMetadata:
    """Metadata for one pass of a ``RaggedBatch`` (no Python loop over sequences)."""
    tables = batch.block_tables
    if tables.shape[1] == 0:  # an empty pass still needs a 2-D table
        tables = tables.new_zeros((tables.shape[0], 1))
    return CpuAttentionMetadata(batch.slot_mapping, tables, batch.cu_seqlens_q, batch.seq_lens)


def write_and_attend(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: CpuAttentionMetadata,
    scale,
    sliding_window,
    soft_cap,
    k_scale=1.0,
    v_scale=1.0,
):
    """Write the pass's ``k/v [T, KVH, D]`` at their slots, then attend: ``[T, H * D]`` (an fp8 cache
    written and read with ``k_scale`` / ``v_scale``)."""
    reference.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seq_lens,
        scale,
        sliding_window,
        soft_cap,
        k_scale,
        v_scale,
    )
    return out.flatten(1)
