"""Weight-only quantized matmuls: ``y = x W^T`` with ``W`` kept as small integers plus group scales.

The weight's canonical form (``QuantizedWeight``, ``Float8Weight``) lives in
``fuseserve.kernels.quant_weight``, the kernels that lay it out (``PackedLinear`` and its subclasses,
``KERNELS``) in ``fuseserve.kernels.quant_kernels``; both are re-exported here. This module picks the
kernel for a weight and packs it:

- ``kernels_for(device)``: ``KERNELS`` plus ``cpu_gemv`` (CPU, with a C++ compiler:
  ``fuseserve.kernels.cpu_quant_linear``, the packed integers widened block by block inside a C++ loop
  for passes of few rows) and ``triton`` / ``triton-splitk`` (CUDA:
  ``fuseserve.kernels.triton_quant_linear``, dequantizing inside a Triton GEMM; the second splits K
  over programs in passes of at most 16 rows);
- ``choose_kernel`` picks among the kernels that accept the weight on this device by measuring them on
  the layer's shape (1 and 16 rows), after checking each against the reference; the choice is cached
  per shape;
- ``pack`` lays a weight out for the chosen kernel (a ``Float8Weight`` always as ``FP8Weight``).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from fuseserve.kernels.quant_kernels import (
    INT4PACK_GROUPS,
    KERNELS,
    Dequant,
    FP8Weight,
    Int4Pack,
    Int4PackX2,
    Int8Pack,
    PackedLinear,
)
from fuseserve.kernels.quant_weight import Float8Weight, QuantizedWeight, reference_linear

__all__ = [
    "INT4PACK_GROUPS",
    "KERNELS",
    "Dequant",
    "FP8Weight",
    "Float8Weight",
    "Int4Pack",
    "Int4PackX2",
    "Int8Pack",
    "PackedLinear",
    "QuantizedWeight",
    "candidates",
    "choose_kernel",
    "kernels_for",
    "pack",
    "reference_linear",
]

log = logging.getLogger(__name__)


def kernels_for(device: torch.device) -> dict[str, type[PackedLinear]]:
    """``KERNELS`` plus, on the CPU where a C++ compiler builds it, the few-row C++ kernel
    (``fuseserve.kernels.cpu_quant_linear``), and on CUDA where Triton imports, the Triton GEMM
    (``fuseserve.kernels.triton_quant_linear``)."""
    kernels = dict(KERNELS)
    if torch.device(device).type == "cpu":
        from fuseserve.kernels import cpu_quant_linear

        if cpu_quant_linear.available():
            kernels[cpu_quant_linear.CpuQuantGemv.name] = cpu_quant_linear.CpuQuantGemv
    if torch.device(device).type == "cuda":
        try:
            from fuseserve.kernels.triton_quant_linear import TritonQuantLinear, TritonQuantLinearSplitK
        except ImportError:
            return kernels
        for kernel in (TritonQuantLinear, TritonQuantLinearSplitK):
            kernels[kernel.name] = kernel
    return kernels


def candidates(w: QuantizedWeight, device: torch.device) -> list[str]:
    """Names of the kernels that accept ``w`` on ``device``."""
    return [name for name, k in kernels_for(device).items() if k.accepts(w, device)]


def choose_kernel(w: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> str:
    """The fastest kernel for ``w`` among ``candidates``, by measurement on random inputs of 1 and
    16 rows (each candidate first checked against the reference: relative error ≤ 1e-3 in fp32,
    ≤ 3e-2 in 16-bit types). Cached per (shape, bits, group, act-order, dtype, device)."""
    return _choose(tuple(w.shape), w.bits, w.group_size, w.perm is not None, dtype, str(device))


@functools.cache
def _choose(shape, bits, group, permuted, dtype, device) -> str:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    w = _probe_weight(shape, bits, group, gen)
    names = candidates(w, device)
    if len(names) == 1:
        return names[0]
    xs = [torch.randn(m, shape[1], generator=gen).to(dtype).to(device) for m in (1, 16)]
    ref = Dequant(w, dtype).to(device)
    want = [ref(x).float() for x in xs]
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    kernels: dict[str, PackedLinear] = {}
    classes = kernels_for(device)
    for name in names:
        kernel = ref if name == "dequant" else classes[name](w, dtype).to(device)
        got = [kernel(x).float() for x in xs]
        if any((g - r).norm() > tol * r.norm() for g, r in zip(got, want, strict=True)):
            log.warning("quantized kernel %s disagrees with the reference on %s; not used", name, shape)
            continue
        kernels[name] = kernel
    times = _race(kernels, xs)
    best = min(times, key=times.get)
    log.info(
        "quantized linear %s %d-bit g%d %s: %s (%s)",
        shape,
        bits,
        group,
        str(dtype).split(".")[-1],
        best,
        ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items()),
    )
    return best


def _probe_weight(shape, bits, group, gen: torch.Generator | None = None) -> QuantizedWeight:
    """A random weight of this shape and format (for eligibility and timing)."""
    n, k = shape
    gen = gen or torch.Generator().manual_seed(0)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    offset = -scale * 2 ** (bits - 1) + torch.randn(n, k // group, generator=gen) * 1e-3
    return QuantizedWeight(q, scale, offset, bits, group)


def _race(kernels: dict[str, PackedLinear], xs: list[torch.Tensor], rounds: int = 4) -> dict[str, float]:
    """Seconds per kernel: the sum over ``xs`` of the fastest of ``rounds`` calls, the kernels taking
    turns within each round (on a shared, noisy CPU the minimum of interleaved runs is the fair
    comparison). A kernel over 3x slower than the best after the first round runs no more."""
    best = {name: [float("inf")] * len(xs) for name in kernels}
    for r in range(rounds):
        for name, kernel in kernels.items():
            for i, x in enumerate(xs):
                _sync(x)
                start = time.perf_counter()
                kernel(x)
                _sync(x)
                best[name][i] = min(best[name][i], time.perf_counter() - start)
        if r == 0:
            fastest = min(sum(v) for v in best.values())
            kernels = {name: k for name, k in kernels.items() if sum(best[name]) <= 3 * fastest}
    return {name: sum(v) for name, v in best.items()}


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def pack(
    w: QuantizedWeight | Float8Weight, dtype: torch.dtype, device: torch.device, kernel: str | None = None
) -> PackedLinear:
    """``w`` laid out for ``kernel`` (default: ``choose_kernel``) in compute ``dtype`` on ``device``
    (a ``Float8Weight`` always as ``FP8Weight``).

    Raises ``ValueError`` for a kernel that does not accept ``w`` on ``device``.
    """
    device = torch.device(device)
    if isinstance(w, Float8Weight):
        return FP8Weight(w.weight, w.scale, dtype).to(device)
    name = kernel or choose_kernel(w, dtype, device)
    cls = kernels_for(device)[name]
    if not cls.accepts(w, device):
        raise ValueError(
            f"kernel {name} does not accept a {w.bits}-bit weight {w.shape} in groups of {w.group_size}"
        )
    return cls(w, dtype).to(device)
