"""Fused element-wise CPU operators for the decoder layers (``cpu_fused.cpp``): RMSNorm, residual add +
RMSNorm, SiLU-and-multiply and in-place rotary, one call each instead of 4-9 ATen ops.

They serve the eager forward on CPU in fp32 and bf16 (``usable``); under ``torch.compile`` inductor
fuses the same element-wise work itself, so the layers call them only outside compilation. The
arithmetic is the unfused ops' (``services/worker/models/layers.py``), rounding where they round; the
sum of squares and silu's exp may differ by one rounding step (the source's header says where).

Build: at first use, by ``cpu_build`` (with ``-ffp-contract=off``: products and sums round apart, as
ATen's separate ops do). Without a compiler ``usable`` is False and the layers run the ATen ops.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fuseserve.kernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_fused.cpp")
EXTRA_FLAGS = ("-ffp-contract=off",)
DTYPES = (torch.float32, torch.bfloat16)
ENABLED = os.environ.get("FUSESERVE_CPU_FUSED", "1") != "0"
"""``FUSESERVE_CPU_FUSED=0`` turns the operators off (the layers then run ATen's ops), as does setting
this to False (``benchmarks.pass_profile``'s ``unfused`` variant)."""


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_fused``, building the library first if needed. Raises
    ``cpu_build.CpuKernelUnavailable`` without a compiler or when the build fails."""
    return cpu_build.load(SOURCE, "fuseserve_fused", EXTRA_FLAGS)


@functools.cache
def available() -> bool:
    """Whether the operators build and load here (the first call may compile them; logged once if not)."""
    return cpu_build.loads(
        load, "fused CPU element-wise operators (the layers use ATen ops)", logging.WARNING
    )


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a layer should call these operators on ``tensors``: enabled (``ENABLED``), eager (not
    compiling), all on the CPU, one dtype among fp32 / bf16, and the library loads."""
    if not ENABLED or torch.compiler.is_compiling():
        return False
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return False
    return available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm of ``x [..., n]`` with ``weight [n]`` → ``[..., n]`` (``layers.RMSNorm``'s arithmetic)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    load().rms_norm(out, rows, weight, float(eps), unit_offset)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, n] + residual [T, n]`` and its RMSNorm: ``(normed, sum)``, both ``[T, n]``."""
    out, total = torch.empty_like(x), torch.empty_like(x)
    load().add_rms_norm(out, total, x, residual, weight, float(eps), unit_offset)
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 I]`` (gate first) → ``[T, I]``."""
    out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    load().silu_mul(out, gate_up)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value of ``x [S, V]`` → int64 ``[S]``, as
    ``x.max(dim=-1).indices`` (NaN counts as the largest), rows in parallel."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    load().argmax(out, x)
    return out


def rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates ``q [T, H, D]`` and ``k [T, KVH, D]`` in place by ``positions [T]`` (int64) through the
    fp32 tables ``cos`` / ``sin [max_positions, R]`` (half-split layout; the first R dims of each head).
    Raises ``RuntimeError`` for a position outside the tables."""
    load().rotary(q, k, positions, cos, sin)
