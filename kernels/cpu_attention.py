"""CPU paged ragged attention: a C++ operator compiled at first use, and its attention backend.

``cpu_attention.cpp`` attends every query of a SplitFuse pass (prefill chunks and decode tokens, one
call) to its keys where they lie in the paged cache: it walks each sequence's block table, widens one
block of K/V at a time to fp32, and keeps flash-attention's running max and sum (online softmax) for
a prefill tile; decode rows read every KV head of a cache row together and take their softmax in two
passes over the keys (the source's header says how). Nothing is gathered or copied per layer. The
reference (``kernels/reference.py``) copies each sequence's whole K/V out of the cache per layer and
loops over prefill chunks in Python. One exception, measured: on CPUs with AMX, bf16 prefill chunks of
``SDPA_MIN_TOKENS`` or more go to PyTorch's flash SDPA (the reference's per-chunk call, its K/V
gathered), which reaches AMX tiles through oneDNN; the rest of the pass stays in the operator
(``sdpa_prefill``, ``SdpaSplit``).

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


SDPA_MIN_TOKENS = 32
"""Prefill chunks of at least this many tokens go to PyTorch's flash SDPA instead of the operator where
``sdpa_prefill()`` says it is faster; decodes and shorter chunks stay in the operator."""


@functools.cache
def sdpa_prefill() -> bool:
    """Whether prefill chunks in bf16 run faster in PyTorch's CPU flash SDPA than in the operator here:
    on CPUs with AMX (``amx_bf16``), whose bf16 tile matmuls SDPA reaches through oneDNN. Measured
    (``benchmarks.cpu_attention_micro``, 30 layers, SmolLM2 shapes, 2 threads, Xeon with AMX): a fresh
    256-token chunk 11.1 ms in SDPA vs 27.2 in the operator, 128 after 128 8.4 vs 19.4; on an AVX-512
    Zen 4 without AMX the two were at parity (0.92x), so there the operator keeps every row."""
    return "amx_bf16" in cpu_build.cpu_signature().split()


class CpuAttentionMetadata:
    """Per-pass inputs of the C++ operator: the batch's own int32 tensors, made contiguous once; and,
    where long prefill chunks go to SDPA (``split``), the operator's share of the pass."""

    def __init__(self, slot_mapping, block_tables, cu_seqlens_q, seq_lens, split=None):
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.split: SdpaSplit | None = split


class SdpaSplit:
    """A pass divided between SDPA (``prefills``: chunks of ``SDPA_MIN_TOKENS`` tokens or more) and the
    operator (``rest``: the other sequences as their own ``CpuAttentionMetadata``, their tokens
    ``token_idx [T']`` of the pass; None when every sequence is a long prefill chunk)."""

    def __init__(self, prefills: list[reference.PrefillChunk], rest, token_idx, prefix: bool = False):
        self.prefills = prefills
        self.rest: CpuAttentionMetadata | None = rest
        self.token_idx: torch.Tensor | None = token_idx
        self.prefix = prefix  # the operator's tokens are the pass's first ones (decodes come first)
        self._masks: dict = {}

    def masks(self, sliding_window: int | None) -> list:
        """Each prefill chunk's visibility mask for this window (None: causal), built once per pass."""
        if sliding_window not in self._masks:
            self._masks[sliding_window] = [c.mask(sliding_window) for c in self.prefills]
        return self._masks[sliding_window]


def plan(batch: Any, block_size: int = 0) -> CpuAttentionMetadata:
    """Metadata for one pass of a ``RaggedBatch`` (no Python loop over sequences unless long prefill
    chunks go to SDPA: ``sdpa_prefill()`` and ``block_size`` given)."""
    tables = batch.block_tables
    if tables.shape[1] == 0:  # an empty pass still needs a 2-D table
        tables = tables.new_zeros((tables.shape[0], 1))
    split = None
    if block_size and sdpa_prefill() and max(batch.query_lens, default=0) >= SDPA_MIN_TOKENS:
        split = _split(batch, tables, block_size)
    return CpuAttentionMetadata(batch.slot_mapping, tables, batch.cu_seqlens_q, batch.seq_lens, split)


def _split(batch: Any, tables: torch.Tensor, block_size: int) -> SdpaSplit:
    prefills, keep, idx, start = [], [], [], 0
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        if q_len >= SDPA_MIN_TOKENS:
            blocks = reference.context_blocks(tables[i], ctx, block_size)
            prefills.append(reference.PrefillChunk(start, start + q_len, blocks, ctx))
        else:
            keep.append(i)
            idx.extend(range(start, start + q_len))
        start += q_len
    if not keep:
        return SdpaSplit(prefills, None, None)
    rows = torch.tensor(keep)
    q_lens = torch.tensor([batch.query_lens[i] for i in keep])
    cu = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)])
    rest = CpuAttentionMetadata(None, tables[rows], cu, batch.seq_lens[rows])
    return SdpaSplit(prefills, rest, torch.tensor(idx), prefix=idx[-1] + 1 == len(idx))


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
    soft-cap send the long prefill chunks to SDPA and the rest of the pass to the operator."""
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
    for c, mask in zip(split.prefills, split.masks(sliding_window), strict=True):
        out[c.start : c.end] = reference.prefill_attention(q, k_cache, v_cache, c, mask, scale)
    return out.flatten(1)


def _operator(q, k_cache, v_cache, meta: CpuAttentionMetadata, *args) -> torch.Tensor:
    """``paged_attention`` of ``q [T, H, D]`` over ``meta``'s block tables and lengths → ``[T, H, D]``."""
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, *args)
