"""Attention backends and the scoped forward context through which batch metadata reaches attention.

Model files call ``attention(layer_idx, q, k, v, scale, sliding_window=..., soft_cap=...)``; the backend (torch reference, Triton,
flash-attn) and its per-pass metadata come from the ``ForwardContext`` the runner opens around the
forward pass. Model code never branches on the device or the backend (STYLE 6, 9).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fuseserve.kernels import cpu_attention, reference
from fuseserve.worker.kv_cache import KVCache
from fuseserve.worker.ragged_batch import RaggedBatch

log = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Paged ragged attention over a ``KVCache``.

    Contract: ``prepare`` runs once per pass and returns backend-specific metadata; ``forward``
    writes the pass's K/V into the cache at ``batch.slot_mapping`` and returns the attention output
    ``[T, num_heads * head_dim]`` for queries ``q [T, num_heads, head_dim]``. Each query attends
    causally to its own sequence (earlier chunks included, through the cache); with
    ``sliding_window`` W, only to the last W positions (itself included). With ``soft_cap`` c the
    scores ``s = scale * q.k`` become ``c * tanh(s / c)`` before softmax (Gemma 2). Window and cap are
    per layer (one model may alternate windowed and global layers), so they come with each call.
    """

    name: str = "abstract"

    @abstractmethod
    def prepare(self, batch: RaggedBatch, block_size: int) -> Any: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend(AttentionBackend):
    """PyTorch reference backend (``fuseserve.kernels.reference``): the test oracle, and the CPU fallback
    when the C++ operator cannot be built."""

    name = "torch"

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return reference.plan_attention(
            batch.query_lens, batch.context_lens, batch.block_tables, batch.slot_mapping, block_size
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None):
        reference.write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = reference.paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window, soft_cap)
        return out.flatten(1)


class CpuAttentionBackend(AttentionBackend):
    """C++ paged ragged attention for CPUs (``fuseserve.kernels.cpu_attention``): one call per layer
    serves the whole pass, reading K/V from the cache blocks in place. Raises
    ``CpuKernelUnavailable`` at construction when the operator cannot be built here."""

    name = "cpu"

    def __init__(self) -> None:
        cpu_attention.load()

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return cpu_attention.plan(batch)

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None):
        return cpu_attention.write_and_attend(
            q, k, v, k_cache, v_cache, metadata, scale, sliding_window, soft_cap
        )


@functools.cache
def _cpu_fallback_warning(reason: str) -> None:
    log.warning("CPU attention operator unavailable, using the PyTorch reference: %s", reason)


@dataclass
class ForwardContext:
    """Everything attention needs for one pass: backend, its metadata, the KV cache."""

    backend: AttentionBackend
    metadata: Any
    kv_cache: KVCache


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "fuseserve_forward", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` visible to ``attention()`` calls inside the ``with`` block (and only there)."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def attention(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Paged attention of layer ``layer_idx``: ``q [T, H, D]``, ``k/v [T, KVH, D]`` → ``[T, H*D]``.

    ``sliding_window`` (tokens) and ``soft_cap`` are this layer's; None means full causal attention
    and uncapped scores. Raises ``RuntimeError`` when called outside ``forward_context``.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("attention() called outside a forward_context")
    return ctx.backend.forward(
        q,
        k,
        v,
        ctx.kv_cache.k[layer_idx],
        ctx.kv_cache.v[layer_idx],
        ctx.metadata,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )


def get_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """Backend by name: ``torch`` (reference), ``cpu`` (C++ operator), ``auto`` (the best for ``device``).

    ``auto`` on a CPU device is ``cpu`` when its operator builds, else ``torch`` (warned once).
    Raises ``ValueError`` for an unknown name and ``CpuKernelUnavailable`` for ``cpu`` without a build.
    """
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "auto":
        if device is None or torch.device(device).type == "cpu":
            try:
                return CpuAttentionBackend()
            except cpu_attention.CpuKernelUnavailable as e:
                _cpu_fallback_warning(str(e))
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, cpu")
