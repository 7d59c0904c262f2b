"""FP8 KV cache: keys and values stored as float8 e4m3 with one scale per tensor (K and V per layer).

A cached value is ``x_fp8 = saturate(x / scale)`` (``torch.float8_e4m3fn``: 4 exponent bits, 3
mantissa bits, largest finite value 448, no infinities), so ``x ≈ x_fp8 * scale``. Every attention
kernel reads the fp8 cache and folds the scales into work it already does instead of rescaling each
element: the K scale multiplies the softmax scale (``scale * q.(k_fp8 * k_scale) = (scale * k_scale)
* q.k_fp8``) and the V scale multiplies the output (softmax weights sum to one), so
``attention(q, K, V) = v_scale * attention'(q, K_fp8, V_fp8)`` with ``attention'`` using
``scale * k_scale``.

The scale is 1.0 (``DEFAULT_SCALE``), as vLLM's default when a checkpoint carries no KV scales: the
K and V of the models served here lie well inside e4m3's range (SmolLM2-135M on a 200-token text:
largest |K| 23.7, largest |V| 10.2, against 448), and values past ±448 saturate instead of becoming
NaN. Per-layer scales calibrated as amax / 448 on a 128-token random prompt (and twice that) were
measured worse on SmolLM2 (mean |logit - fp32| 0.42 and 0.35 against 0.29 with 1.0, teacher-forced
on three prompts; at amax / 448 some real-text K values exceed the calibration's and saturate, why
twice that is still worse was not isolated). A fixed scale also keeps the cached bytes of a prefix
the same whatever ran before it, so prefix caching and every tensor-parallel rank agree without
exchanging statistics. ``KVCache.k_scale`` / ``v_scale`` carry a scale per layer for every kernel,
so a checkpoint's own scales can be loaded there.
"""

from __future__ import annotations

import torch

from fuseserve.config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_SCALE = 1.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for ``--kv-cache-dtype name``: ``auto`` → ``model_dtype``,
    ``fp8`` → ``torch.float8_e4m3fn``. Raises ``ValueError`` for another name."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def is_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` is an fp8 cache."""
    return t.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` (any float dtype) → fp8 e4m3 ``x / scale``, saturated at ±448 (round to nearest even)."""
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``x`` → ``x * scale`` in ``dtype`` (a non-fp8 ``x`` is returned as it is)."""
    if x.dtype != FP8:
        return x
    y = x.to(dtype)
    return y if scale == 1.0 else y * scale
