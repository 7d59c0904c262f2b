"""Attention backends and the scoped forward context through which batch metadata reaches the layers.

Model files call ``attention(layer_idx, q, k, v, scale, sliding_window=..., soft_cap=...)``; the backend (torch reference, Triton,
flash-attn) and its per-pass metadata come from the ``ForwardContext`` the runner opens around the
forward pass. Model code never branches on the device or the backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fuseserve.config import ATTENTION_BACKENDS
from fuseserve.errors import AttentionBackendUnavailableError, InvalidParameterError
from fuseserve.kernels import cpu_attention, kv_quant, reference
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
    The caches hold the model's dtype or fp8 (``fuseserve.kernels.kv_quant``): an fp8 cache is written
    as ``k / k_scale``, ``v / v_scale`` and read back through the same scales (this layer's).
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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...


class TorchAttentionBackend(AttentionBackend):
    """PyTorch reference backend (``fuseserve.kernels.reference``): the test oracle, and the CPU fallback
    when the C++ operator cannot be built."""

    name = "torch"

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return reference.plan_attention(
            batch.query_lens, batch.context_lens, batch.block_tables, batch.slot_mapping, block_size
        )

    def forward(
        self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None, **kv_scales
    ):
        reference.write_kv(k_cache, v_cache, k, v, metadata.slot_mapping, **kv_scales)
        out = reference.paged_attention(
            q, k_cache, v_cache, metadata, scale, sliding_window, soft_cap, **kv_scales
        )
        return out.flatten(1)


class CpuAttentionBackend(AttentionBackend):
    """C++ paged ragged attention for CPUs (``fuseserve.kernels.cpu_attention``): one call per layer
    serves the whole pass, reading K/V from the cache blocks in place. Raises
    ``CpuKernelUnavailable`` at construction when the operator cannot be built here."""

    name = "cpu"

    def __init__(self) -> None:
        cpu_attention.load()

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return cpu_attention.plan(batch, block_size)

    def forward(
        self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None, **kv_scales
    ):
        return cpu_attention.write_and_attend(
            q, k, v, k_cache, v_cache, metadata, scale, sliding_window, soft_cap, **kv_scales
        )


@dataclass
class ForwardContext:
    """Everything the layers need for one pass: the attention backend, its metadata, the KV cache,
    the number of real tokens when the pass is padded to a compiled shape, and the pass's LoRA
    adapters (``lora_layers.LoRABatch``: which tokens each adapter slot holds; None without any)."""

    backend: AttentionBackend
    metadata: Any
    kv_cache: KVCache
    num_tokens: int | None = None  # the batch's tokens when a compiled pass pads them (else None)
    lora: Any = None
    memo: dict = field(default_factory=dict)  # per-pass values the layers share (``pass_memo``)


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


def current_context() -> ForwardContext:
    """The ``ForwardContext`` of the pass being run; ``RuntimeError`` outside ``forward_context``."""
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("no forward_context is open")
    return ctx


def pass_memo() -> dict | None:
    """A dict that lives for the pass being run (``ForwardContext.memo``): what every layer would
    otherwise compute again from the same inputs (the rotary cos / sin of the pass's positions); None
    outside a pass."""
    ctx = _CONTEXT.get()
    return None if ctx is None else ctx.memo


def current_lora() -> Any:
    """The LoRA metadata of the pass being run (``ForwardContext.lora``); None outside a pass or when
    no token of the pass has an adapter."""
    ctx = _CONTEXT.get()
    return None if ctx is None else ctx.lora


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
    if torch.compiler.is_compiling():  # one opaque call in the compiled graph (``compiled_forward``)
        return torch.ops.fuseserve.attention(q, k, v, layer_idx, scale, sliding_window or 0, soft_cap or 0.0)
    return _attend(layer_idx, q, k, v, scale, sliding_window, soft_cap)


def _attend(layer_idx, q, k, v, scale, sliding_window, soft_cap) -> torch.Tensor:
    """``attention()`` through the current ``ForwardContext``'s backend. A compiled pass may carry
    padding rows beyond the batch's tokens (``ForwardContext.num_tokens``): they are left out of the
    KV write and attention, and their output is zero."""
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("attention() called outside a forward_context")
    num_tokens = q.shape[0] if ctx.num_tokens is None else ctx.num_tokens
    padded = q.shape[0] - num_tokens
    if padded:
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
    out = ctx.backend.forward(
        q,
        k,
        v,
        ctx.kv_cache.k[layer_idx],
        ctx.kv_cache.v[layer_idx],
        ctx.metadata,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=ctx.kv_cache.k_scale[layer_idx],
        v_scale=ctx.kv_cache.v_scale[layer_idx],
    )
    return torch.nn.functional.pad(out, (0, 0, 0, padded)) if padded else out


@torch.library.custom_op("fuseserve::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """``attention()`` as one operator for ``torch.compile``: the compiler sees an opaque call
    ``[T, H, D]`` → ``[T, H*D]``; the KV cache and the metadata come from the ``ForwardContext`` at
    run time (0 = no window / no cap)."""
    return _attend(layer_idx, q, k, v, scale, sliding_window or None, soft_cap or None)


@_attention_op.register_fake
def _(q, k, v, layer_idx, scale, sliding_window, soft_cap):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class TritonAttentionBackend(AttentionBackend):
    """Triton paged ragged attention (``fuseserve.kernels.triton_attention``): one launch per layer for
    the whole pass, and a Triton KV-cache write. Compiled on CUDA; interpreted on CPU (tests only).

    ``num_splits``: split-KV parts for every launch (None: chosen per launch from grid size and the
    longest context).
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        from fuseserve.kernels import triton_attention

        self._kernels = triton_attention
        self.num_splits = num_splits

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return self._kernels.plan_attention(
            batch.query_lens,
            batch.context_lens,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            block_size,
            self.num_splits,
        )

    def forward(
        self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None, **kv_scales
    ):
        self._kernels.write_kv(k_cache, v_cache, k, v, metadata.slot_mapping, **kv_scales)
        out = self._kernels.paged_attention(
            q, k_cache, v_cache, metadata, scale, sliding_window, soft_cap, **kv_scales
        )
        return out.flatten(1)


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 varlen attention with a block table (``fuseserve.kernels.flash_attn``): SM80+,
    fp16/bf16, block sizes that are multiples of 256. K/V are written by the Triton write kernel."""

    name = "flash-attn"

    def __init__(self):
        from fuseserve.kernels import flash_attn, triton_kv_write

        self._flash = flash_attn
        self._write_kv = triton_kv_write.write_kv

    def prepare(self, batch: RaggedBatch, block_size: int) -> Any:
        return self._flash.plan_attention(
            batch.query_lens, batch.context_lens, batch.cu_seqlens_q, batch.block_tables, batch.slot_mapping
        )

    def forward(
        self, q, k, v, k_cache, v_cache, metadata, scale, sliding_window=None, soft_cap=None, **kv_scales
    ):
        if k_cache.dtype == kv_quant.FP8:  # get_backend never picks flash-attn for an fp8 cache
            raise AttentionBackendUnavailableError("flash-attn reads no fp8 KV cache")
        self._write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = self._flash.paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window, soft_cap)
        return out.flatten(1)


def triton_unavailable_reason(device: torch.device | None) -> str | None:
    """None when the Triton backend can run on ``device``, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    if device is None or device.type != "cuda":
        return "Triton kernels compile for CUDA only (on CPU they run interpreted, for tests)"
    return None


_LOGGED: set[tuple[str, str]] = set()


def _log_choice(name: str, why: str, level: int = logging.INFO) -> None:
    """Log the backend chosen and why, once per distinct choice."""
    if (name, why) not in _LOGGED:
        _LOGGED.add((name, why))
        log.log(level, "attention backend: %s (%s)", name, why)


def get_backend(
    name: str = "auto",
    device: torch.device | None = None,
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Attention backend by name: ``torch`` (reference), ``cpu`` (C++ operator), ``triton``,
    ``flash-attn`` or ``auto``. ``kv_cache_dtype``: the cache's storage dtype when it differs from
    ``dtype`` (fp8: every backend but flash-attn reads it).

    ``auto`` takes flash-attn when it imports, the GPU is SM80+ and ``block_size``/``dtype`` suit it;
    else Triton on CUDA; on CPU the ``cpu`` operator when it builds, else the torch reference (warned
    once). The choice is logged once.
    A forced ``triton`` runs on CPU too, interpreted (slow, for tests): the process must start with
    ``TRITON_INTERPRET=1``. Raises
    ``InvalidParameterError`` for an unknown name, ``AttentionBackendUnavailableError`` when a forced
    backend cannot run here.
    """
    if name not in ATTENTION_BACKENDS:
        raise InvalidParameterError("attention_backend", name, ", ".join(ATTENTION_BACKENDS))
    flash_reason = _flash_reason(device, block_size, dtype, kv_cache_dtype)
    if name == "auto":
        return _auto_backend(device, flash_reason)
    return _forced_backend(name, device, flash_reason)


def _flash_reason(device, block_size, dtype, kv_cache_dtype) -> str | None:
    """None when flash-attn can serve this worker, else why not."""
    from fuseserve.kernels import flash_attn

    if kv_cache_dtype == kv_quant.FP8:
        return "flash-attn reads no fp8 KV cache (--kv-cache-dtype fp8: triton on GPUs)"
    return flash_attn.unsupported_reason(device, block_size, dtype)


def _forced_backend(name: str, device: torch.device | None, flash_reason: str | None) -> AttentionBackend:
    """The backend ``name`` (not ``auto``); ``AttentionBackendUnavailableError`` when it cannot run here."""
    if name == "torch":
        _log_choice("torch", "forced")
        return TorchAttentionBackend()
    if name == "cpu":
        try:
            backend = CpuAttentionBackend()
        except cpu_attention.CpuKernelUnavailable as e:
            raise AttentionBackendUnavailableError(f"attention backend cpu: {e}") from e
        _log_choice("cpu", "forced")
        return backend
    if name == "flash-attn":
        if flash_reason:
            raise AttentionBackendUnavailableError(f"attention backend flash-attn: {flash_reason}")
        _log_choice("flash-attn", "forced")
        return FlashAttnBackend()
    try:  # triton
        backend = TritonAttentionBackend()
    except ImportError as e:
        raise AttentionBackendUnavailableError(f"attention backend triton: {e}") from e
    _log_choice("triton", "forced" if device is not None and device.type == "cuda" else "forced, interpreted")
    return backend


def _auto_backend(device: torch.device | None, flash_reason: str | None) -> AttentionBackend:
    """``auto``: flash-attn, else Triton on CUDA, else (off CPU) the torch reference; on CPU the ``cpu``
    operator, else the torch reference (warned once)."""
    if flash_reason is None:
        _log_choice("flash-attn", "auto")
        return FlashAttnBackend()
    triton_reason = triton_unavailable_reason(device)
    if triton_reason is None:
        _log_choice("triton", f"auto; not flash-attn: {flash_reason}")
        return TritonAttentionBackend()
    if device is not None and torch.device(device).type != "cpu":
        _log_choice("torch", f"auto; not flash-attn: {flash_reason}; not triton: {triton_reason}")
        return TorchAttentionBackend()
    try:
        backend = CpuAttentionBackend()
    except cpu_attention.CpuKernelUnavailable as e:
        _log_choice("torch", f"auto; the CPU attention operator is unavailable: {e}", logging.WARNING)
        return TorchAttentionBackend()
    _log_choice("cpu", "auto")
    return backend
