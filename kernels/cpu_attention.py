"""CPU paged ragged attention: a C++ operator compiled at first use, and its attention backend.

``cpu_attention.cpp`` attends every query of a SplitFuse pass (prefill chunks and decode tokens, one
call) to its keys where they lie in the paged cache: it walks each sequence's block table, widens one
block of K/V at a time to fp32, and keeps flash-attention's running max and sum (online softmax) for
a prefill tile; decode rows read every KV head of a cache row together and take their softmax in two
passes over the keys (the source's header says how). Nothing is gathered or copied per layer. The
reference (``kernels/reference.py``) copies each sequence's whole K/V out of the cache per layer and
loops over prefill chunks in Python. One exception, measured: on CPUs with AMX, bf16 prefill chunks of
``PREFILL_MIN_TOKENS`` or more go to ``cpu_prefill.cpp`` (all of a pass's in one call), whose matmuls
are oneDNN batch-reduce GEMMs on AMX tiles; the rest of the pass stays in the operator
(``amx_prefill``, ``PrefillSplit``).

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
PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.cpp")
OP_NAMESPACE = "fuseserve_cpu"
__all__ = [
    "CpuKernelUnavailable",
    "available",
    "load",
    "paged_attention",
    "plan",
    "prefill_attention",
    "write_and_attend",
]


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_cpu``, building the library first if no cached build exists (``cpu_build``);
    where ``amx_prefill()`` holds, the prefill library too (``load_prefill``), so that no pass waits
    for its build.

    Raises ``CpuKernelUnavailable`` when no C++ compiler is on PATH or the build fails.
    """
    ops = cpu_build.load(SOURCE, OP_NAMESPACE)
    if amx_prefill():
        load_prefill()
    return ops


@functools.cache
def load_prefill() -> Any:
    """``torch.ops.fuseserve_prefill`` (``cpu_prefill.cpp``), built as ``load`` builds its library.
    Raises ``CpuKernelUnavailable``."""
    return cpu_build.load(PREFILL_SOURCE, "fuseserve_prefill")


def available() -> bool:
    """Whether the operator builds and loads here (the first call may compile it)."""
    return cpu_build.loads(load)


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


PREFILL_MIN_TOKENS = 32
"""Prefill chunks of at least this many tokens go to ``prefill_attention`` instead of the operator where
``amx_prefill()`` says so; decodes and shorter chunks stay in the operator."""


@functools.cache
def amx_prefill() -> bool:
    """Whether bf16 prefill chunks go to ``prefill_attention`` (AMX tile matmuls through oneDNN) here:
    on CPUs with AMX (``amx_bf16``). Measured (SmolLM2 shapes, 2 threads, Xeon with AMX): PyTorch's
    flash SDPA, which reaches the same tiles, took a fresh 256-token chunk in 11.1 ms for 30 layers
    against 27.2 in the operator; ``prefill_attention`` five 200-token chunks in 1.30-1.34 ms a layer
    against SDPA's ~1.6 (``benchmarks/README.md``). On an AVX-512 Zen 4 without AMX SDPA and the
    operator were at parity (0.92x), so there the operator keeps every row."""
    return "amx_bf16" in cpu_build.cpu_signature().split()


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: list[reference.PrefillChunk],
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Attention of ``chunks``' rows of ``q [T, H, D]`` (bf16) over their cached keys, written into the
    same rows of ``out [T, H, D]``: ``reference.prefill_attention`` for each chunk (causal, window),
    all in one call. bf16 caches ``[num_blocks, block_size, KVH, D]``, any ``D``."""
    ints = [n for c in chunks for n in (c.start, c.end, c.context_len)]
    load_prefill().prefill_attention(
        out, q, k_cache, v_cache, ints, [c.blocks for c in chunks], float(scale), int(sliding_window or 0)
    )


class CpuAttentionMetadata:
    """Per-pass inputs of the C++ operator: the batch's own int32 tensors, made contiguous once; and,
    where long prefill chunks go to ``prefill_attention`` (``split``), the operator's share of the pass."""

    def __init__(self, slot_mapping, block_tables, cu_seqlens_q, seq_lens, split=None):
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.split: PrefillSplit | None = split


class PrefillSplit:
    """A pass divided between ``prefill_attention`` (``prefills``: chunks of ``PREFILL_MIN_TOKENS`` tokens
    or more) and the operator (``rest``: the other sequences as their own ``CpuAttentionMetadata``, their
    tokens ``token_idx [T']`` of the pass; None when every sequence is a long prefill chunk)."""

    def __init__(self, prefills: list[reference.PrefillChunk], rest, token_idx, prefix: bool = False):
        self.prefills = prefills
        self.rest: CpuAttentionMetadata | None = rest
        self.token_idx: torch.Tensor | None = token_idx
        self.prefix = prefix  # the operator's tokens are the pass's first ones (decodes come first)


def plan(batch: Any, block_size: int = 0) -> CpuAttentionMetadata:
    """Metadata for one pass of a ``RaggedBatch`` (no Python loop over sequences unless long prefill
    chunks go to ``prefill_attention``: ``amx_prefill()`` and ``block_size`` given)."""
    tables = batch.block_tables
    if tables.shape[1] == 0:  # an empty pass still needs a 2-D table
        tables = tables.new_zeros((tables.shape[0], 1))
    split = None
    if block_size and amx_prefill() and max(batch.query_lens, default=0) >= PREFILL_MIN_TOKENS:
        split = _split(batch, tables, block_size)
    return CpuAttentionMetadata(batch.slot_mapping, tables, batch.cu_seqlens_q, batch.seq_lens, split)


def _split(batch: Any, tables: torch.Tensor, block_size: int) -> PrefillSplit:
    prefills, keep, idx, start = [], [], [], 0
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        if q_len >= PREFILL_MIN_TOKENS:
            blocks = reference.context_blocks(tables[i], ctx, block_size)
            prefills.append(reference.PrefillChunk(start, start + q_len, blocks, ctx))
        else:
            keep.append(i)
            idx.extend(range(start, start + q_len))
        start += q_len
    if not keep:
        return PrefillSplit(prefills, None, None)
    rows = torch.tensor(keep)
    q_lens = torch.tensor([batch.query_lens[i] for i in keep])
    cu = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)])
    rest = CpuAttentionMetadata(None, tables[rows], cu, batch.seq_lens[rows])
    return PrefillSplit(prefills, rest, torch.tensor(idx), prefix=idx[-1] + 1 == len(idx))


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
    written and read with ``k_scale`` / ``v_scale``). With ``meta.split``, bf16 layers without a
    soft-cap send the long prefill chunks to ``prefill_attention`` and the rest of the pass to the operator."""
    reference.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    split = meta.split
    if split is None or soft_cap is not None or q.dtype != torch.bfloat16 or k_cache.dtype != q.dtype:
        return _operator(
            q, k_cache, v_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale
        ).flatten(1)
    out = torch.empty_like(q)
    if split.rest is not None and split.prefix:
        n = split.token_idx.shape[0]
        out[:n] = _operator(q[:n], k_cache, v_cache, split.rest, scale, sliding_window)
    elif split.rest is not None:
        rows = q.index_select(0, split.token_idx)
        out.index_copy_(
            0, split.token_idx, _operator(rows, k_cache, v_cache, split.rest, scale, sliding_window)
        )
    prefill_attention(out, q, k_cache, v_cache, split.prefills, scale, sliding_window)
    return out.flatten(1)


def _operator(q, k_cache, v_cache, meta: CpuAttentionMetadata, *args) -> torch.Tensor:
    """``paged_attention`` of ``q [T, H, D]`` over ``meta``'s block tables and lengths → ``[T, H, D]``."""
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, *args)
