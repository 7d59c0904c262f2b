"""bf16 linears for decode-size passes on AMX CPUs (``cpu_linear.cpp``): a second copy of a weight packed
once at load into 64-column blocks, each product a set of oneDNN batch-reduce GEMMs that the threads
take block by block.

A decode pass reads every weight for a few rows; oneDNN's packed matmul read SmolLM2's at 11-18 GB/s
with two threads, these blocks at 18-23 GB/s, while from 256 rows on oneDNN's matmul was the faster
(``benchmarks/README.md``, "Decode-size linears of our own"). ``services/worker/prepacked_linear.py``
gives a bf16 weight this copy where ``packable`` says so (oneDNN has a bf16 brgemm here, i.e. AMX;
``N % 16 == 0``, ``K % 32 == 0``) and the copies fit in a quarter of the available RAM;
``kernels/cpu_stack.cpp``'s ``linear`` (the one entry point of packed linears, Python layers and C++
stack alike) multiplies passes of at most 32 rows by it. ``FUSESERVE_AMX_LINEAR=0`` makes no copies.

Build: at first use, by ``cpu_build`` (as ``cpu_fused``). Without a compiler ``available`` is False and
oneDNN's matmul serves every pass.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from fuseserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
ENABLED = os.environ.get("FUSESERVE_AMX_LINEAR", "1") != "0"


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_linear``, building the library first if needed. Raises
    ``cpu_build.CpuKernelUnavailable`` without a compiler or when the build fails."""
    return cpu_build.load(SOURCE, "fuseserve_linear")


@functools.cache
def available() -> bool:
    """Whether the operators build and load here and oneDNN multiplies bf16 on AMX tiles (the first
    call may compile; the reason is logged once if not)."""
    return cpu_build.loads(load, "bf16 linears of our own (oneDNN's packed matmul stays)") and load().usable()


def packable(weight: torch.Tensor) -> bool:
    """Whether ``pack`` takes ``weight`` (a CPU bf16 ``[N, K]``, ``N % 16 == 0``, ``K % 32 == 0``) here,
    with ``ENABLED``."""
    if not ENABLED or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return available() and load().packable(*weight.shape)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` bf16 → the packed weight: a bf16 tensor of the same shape holding 64-column VNNI
    blocks (``cpu_linear.cpp``'s layout), for ``linear`` only. Raises ``RuntimeError`` where
    ``packable`` is False."""
    return load().pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, K]`` bf16 times a ``pack``-ed weight ``[N, K]`` (+ ``bias [N]``) → ``[T, N]`` bf16: fp32
    accumulation, the bias added, rounded once. Raises ``RuntimeError`` on mismatched shapes or dtypes."""
    return load().linear(x, packed, bias)
