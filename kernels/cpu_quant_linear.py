"""A C++ weight-only quantized matmul for few rows on CPUs (decode), and its ``quant_linear`` kernel.

``cpu_quant_linear.cpp`` reads the packed integers once per call (4-bit: half a byte per weight),
dequantizes each weight row into an fp32 row buffer (16 lanes at a time) and dots it with every row
of ``x``: the memory traffic of a decode pass is that of the packed weight, not of an fp32 copy. Layout: the
Triton kernel's (``fuseserve.kernels.triton_quant_linear.pack_weight``). Passes of more than
``SMALL_ROWS`` rows dequantize the same tensors and call ``F.linear`` (a GEMM reuses each weight
across rows, where the dequantized copy costs little).

Build: as the CPU attention operator (``fuseserve.kernels.cpu_attention``): ``c++`` (or ``$CXX``)
compiles the source at first use into ``~/.cache/fuseserve/extensions/`` (``$FUSESERVE_EXTENSIONS_DIR``),
the file named by a hash of the source, flags, torch version and CPU; loaded with
``torch.ops.load_library``. ``available()`` is False (and the kernel not a candidate) without a compiler.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fuseserve.kernels import cpu_attention
from fuseserve.kernels.quant_kernels import PackedLinear
from fuseserve.kernels.quant_weight import QuantizedWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant_linear.cpp")
SMALL_ROWS = 32
"""Passes of at most this many rows run the C++ kernel; larger ones dequantize (the C++ operator) and
call ``F.linear``. Measured on 4-bit SmolLM2 and 1B LLaMA shapes (AVX-512, 2 threads, fp32): the
kernel is the faster up to 16-32 rows, even at 48-64, and 1.1-2x slower from 96 rows on (a GEMM
reuses each weight across rows, so the per-call fp32 copy costs less than the kernel's dot products)."""


def _library_path(cxx: str) -> Path:
    root = Path(
        os.environ.get("FUSESERVE_EXTENSIONS_DIR", Path.home() / ".cache" / "fuseserve" / "extensions")
    )
    h = hashlib.sha256()
    flags = " ".join(cpu_attention._flags())
    for part in (SOURCE.read_bytes(), flags.encode(), torch.__version__.encode(), cxx.encode()):
        h.update(part)
    h.update(cpu_attention._cpu_signature().encode())
    return root / f"fuseserve_cpu_quant_linear_{h.hexdigest()[:16]}.so"


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_cpu_quant``, building the library first if needed. Raises
    ``cpu_attention.CpuKernelUnavailable`` without a compiler or when the build fails."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    target = _library_path(cxx)
    if not target.exists():
        found = shutil.which(cxx)
        if found is None:
            raise cpu_attention.CpuKernelUnavailable(f"no C++ compiler ({cxx!r}) on PATH")
        torch_lib = Path(torch.__file__).parent / "lib"
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            cmd = [found, *cpu_attention._flags(), str(SOURCE), "-o", str(partial)]
            cmd += [f"-I{p}" for p in include_paths()]
            cmd += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
            log.info("building the CPU quantized matmul (once)")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise cpu_attention.CpuKernelUnavailable(
                    f"{cxx} failed on {SOURCE.name}:\n{proc.stderr[-4000:]}"
                )
            os.replace(partial, target)
    try:
        torch.ops.load_library(str(target))
    except OSError as e:
        raise cpu_attention.CpuKernelUnavailable(f"cannot load {target}: {e}") from e
    return torch.ops.fuseserve_cpu_quant


def available() -> bool:
    """Whether the operator builds and loads here (the first call may compile it)."""
    try:
        load()
    except cpu_attention.CpuKernelUnavailable as e:
        log.info("CPU quantized matmul unavailable: %s", e)
        return False
    return True


class CpuQuantGemv(PackedLinear):
    """The C++ kernel up to ``SMALL_ROWS`` rows, dequantize + ``F.linear`` above; fp32 compute;
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
        if x.shape[0] > SMALL_ROWS:
            return F.linear(x, self.weight())
        t = self.tensors
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        torch.ops.fuseserve_cpu_quant.quant_gemv(y, x, t["w"], t["scale"], t["offset"], self.bits, self.group)
        return y
