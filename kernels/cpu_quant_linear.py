"""A C++ weight-only quantized matmul for few rows on CPUs (decode), and its ``quant_linear`` kernel.

``cpu_quant_linear.cpp`` reads the packed integers once per call (4-bit: half a byte per weight),
dequantizes each weight row into an fp32 row buffer (16 lanes at a time) and dots it with every row
of ``x``: the memory traffic of a decode pass is that of the packed weight, not of an fp32 copy. Layout: the
Triton kernel's (``fuseserve.kernels.triton_quant_linear.pack_weight``). Passes of more than
``SMALL_ROWS`` rows dequantize ``WIDEN_CHUNK`` weight rows at a time and multiply them as a GEMM
(``widened_matmul``: a GEMM reuses each weight across rows, where the dequantized chunk costs little).
``Bf16Linear`` runs the same two paths for a float weight kept in bfloat16.

Build: at first use, by ``fuseserve.kernels.cpu_build`` (as the CPU attention operator).
``available()`` is False (and the kernel not a candidate) without a compiler.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fuseserve.kernels import cpu_build
from fuseserve.kernels.quant_kernels import PackedLinear
from fuseserve.kernels.quant_weight import QuantizedWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant_linear.cpp")
SMALL_ROWS = 12
"""Passes of at most this many rows run the C++ kernel; larger ones ``widened_matmul``. Measured on
the 1B LLaMA shape's 4-bit layers (groups of 128; Zen 4, 2 threads, fp32, quiet machine, ms, kernel vs
chunked): 16384 x 2048 at 8 rows 9.6 vs 18.0, at 16 rows 16.6 vs 13.5, at 32 rows 30.9 vs 22.4;
2048 x 8192 4.4 / 7.9, 8.9 / 7.8, 16.7 / 11.1; 3072 x 2048 1.5 / 2.6, 2.9 / 2.2, 5.6 / 3.7: the
kernel's time grows with the rows, the chunked path's little, crossing at about 13 rows. (Before,
above 32 rows the whole matrix was dequantized per call: 78-84, 39-45, 7.4-10.4 ms.)"""


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_cpu_quant``, building the library first if needed (``cpu_build``). Raises
    ``cpu_build.CpuKernelUnavailable`` without a compiler or when the build fails."""
    return cpu_build.load(SOURCE, "fuseserve_cpu_quant")


def available() -> bool:
    """Whether the operator builds and loads here (the first call may compile it)."""
    return cpu_build.loads(load, "CPU quantized matmul")


class CpuQuantGemv(PackedLinear):
    """The C++ kernel up to ``SMALL_ROWS`` rows, ``widened_matmul`` above; fp32 compute;
    bits <= 8, K and group multiples of 32."""

    name = "cpu_gemv"

    @staticmethod
    def accepts(w: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and w.bits <= 8 and w.group_size % 32 == 0 and w.shape[1] % 32 == 0

    def pack(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        from fuseserve.kernels.triton_quant_linear import pack_weight

        load()  # here, not in matmul: torch.compile traces the registered operator, not the loader
        self.dtype = torch.float32  # the C++ kernel computes in fp32 (PackedLinear casts x and y)
        self.bits, self.group = w.bits, w.group_size
        self.tensors = {"w": pack_weight(w), "scale": w.scale.contiguous(), "offset": w.offset.contiguous()}

    def weight(self) -> torch.Tensor:
        """The dequantized ``[N, K]`` (fp32), by the C++ operator."""
        t = self.tensors
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        torch.ops.fuseserve_cpu_quant.dequantize(w, t["w"], t["scale"], t["offset"], self.bits, self.group)
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        if x.shape[0] > SMALL_ROWS:
            dequantize = torch.ops.fuseserve_cpu_quant.dequantize
            return widened_matmul(
                x,
                self.out_features,
                lambda s, e, out: dequantize(
                    out, t["w"][s:e], t["scale"][s:e], t["offset"][s:e], self.bits, self.group
                ),
            )
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        torch.ops.fuseserve_cpu_quant.quant_gemv(y, x, t["w"], t["scale"], t["offset"], self.bits, self.group)
        return y


BF16_SMALL_ROWS = 8
"""``Bf16Linear``: passes of at most this many rows run the C++ kernel; larger ones widen
``WIDEN_CHUNK`` weight rows at a time and multiply. Measured on the 128256 x 2048 LM head (AVX-512, 2
threads, ms): 1 row 25 (fp32 ``F.linear`` 60), 8 rows 98 vs chunked 129, 16 rows 136 vs 107, 64 rows
chunked 244 (fp32 624)."""
WIDEN_CHUNK = 512
"""Weight rows widened to fp32 at a time above the kernels' row limits (4 MiB at K = 2048)."""


class Bf16Linear(PackedLinear):
    """A float weight kept as bfloat16 with fp32 compute: the C++ kernel widens each value exactly up
    to ``BF16_SMALL_ROWS`` rows (2 bytes read per weight, not 4); above, ``WIDEN_CHUNK`` weight rows
    at a time are widened to fp32 and multiplied (``W_chunk @ x^T`` into rows of ``y^T``). ``rows(ids)``
    is its embedding lookup. Equal to ``F.linear`` on the fp32 copy up to summation order; K a
    multiple of 32."""

    name = "bf16_widen"

    def __init__(self, weight: torch.Tensor):
        """``weight [N, K]``, any float dtype whose values bfloat16 holds exactly (``exact_bf16``)."""
        load()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.perm = torch.float32, None
        self.tensors = {"weight": weight.to(torch.bfloat16).contiguous()}

    @staticmethod
    def holds(weight: torch.Tensor) -> bool:
        """Whether ``weight`` is a 2-D CPU float tensor, K a multiple of 32, every value exact in bf16
        (not ``PackedLinear.accepts``: this kernel takes float weights, never a ``QuantizedWeight``)."""
        return (
            weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_floating_point()
            and exact_bf16(weight)
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T]`` → ``[T, K]`` fp32 (an embedding lookup)."""
        return F.embedding(ids, self.tensors["weight"]).float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.tensors["weight"]
        if x.shape[0] <= BF16_SMALL_ROWS:
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            torch.ops.fuseserve_cpu_quant.bf16_gemv(y, x, w)
            return y
        return widened_matmul(x, self.out_features, lambda s, e, out: out.copy_(w[s:e]))


def widened_matmul(x: torch.Tensor, n: int, widen: Callable[[int, int, torch.Tensor], Any]) -> torch.Tensor:
    """``x [M, K] @ W^T`` → ``[M, n]`` fp32, ``W [n, K]`` never whole in fp32: ``widen(start, end, out)``
    writes its rows ``start:end`` into ``out [end - start, K]`` (fp32), ``WIDEN_CHUNK`` rows at a time,
    each chunk multiplied at once (``chunk @ x^T`` into rows of ``y^T``: the chunk stays in cache)."""
    yt = torch.empty(n, x.shape[0], dtype=torch.float32)
    buf = torch.empty(min(WIDEN_CHUNK, n), x.shape[1], dtype=torch.float32)
    for start in range(0, n, WIDEN_CHUNK):
        end = min(start + WIDEN_CHUNK, n)
        widen(start, end, buf[: end - start])
        torch.mm(buf[: end - start], x.t(), out=yt[start:end])
    return yt.t().contiguous()


def exact_bf16(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every value of the float tensor ``t`` is exactly a bfloat16 value (true of a bf16
    checkpoint widened to fp32 on load), tested ``chunk`` values at a time."""
    if t.dtype == torch.bfloat16:
        return True
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        if not torch.equal(part.to(torch.bfloat16).to(part.dtype), part):
            return False
    return True
