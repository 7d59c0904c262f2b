"""Linear layers with their weights packed once, at load, for oneDNN's matmul (CPU, float32 / bfloat16).

``F.linear`` on a float32 CPU tensor calls MKL's sgemm, which re-reads the weight in its plain
layout every call; oneDNN can reorder the weight once into the blocked layout its AVX2 / AVX-512
kernels read (``torch.ops.mkldnn._reorder_linear_weight``), and ``torch.ops.mkldnn._linear_pointwise``
then multiplies by the packed weight directly. Measured on a 2-vCPU AVX2 EPYC with SmolLM2's shapes:
``benchmarks/README.md`` ("Against vLLM"). ``FUSESERVE_PREPACK=0`` keeps ``F.linear`` (to compare).

``prepack(model)`` switches every plain ``nn.Linear`` (quantized layers keep their own kernels) of a
float32 CPU model on one rank (no tensor parallelism) to the packed weight; a bfloat16 model too
where oneDNN has native bf16 kernels (``avx512_bf16`` / AMX: there, SmolLM2's shapes ran 1.1-1.4x
faster than ``F.linear``, bit-identical output; elsewhere bf16 stays on ``F.linear``, not measured): the module keeps the packed weight as the buffer
``packed_weight``, answers ``forward`` from it, and drops its plain weight unless another module
shares that tensor (a tied LM head keeps the embedding's). Output equals ``F.linear`` up to float32
rounding (a different summation order). Under ``torch.compile`` the packed call is the opaque
operator ``fuseserve::packed_linear`` (inductor's own lowering of the oneDNN call rejects float32).
A bf16 pass of at least 192 rows per thread runs as one single-threaded oneDNN call per thread on its
own rows (``kernels/cpu_stack.cpp``'s ``linear``): oneDNN's own two-thread split of such a product
with few outputs ran no faster than one thread on an AMX CPU. On AMX CPUs a bf16 module also keeps
``small_weight``, a second copy in ``kernels/cpu_linear.py``'s blocks that passes of at most 32 rows
(decodes) multiply by, 20-25% faster there; None where it does not apply.
"""

from __future__ import annotations

import functools
import logging
import time
import types
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

BATCH_HINT = 64
"""Rows the packed layout is chosen for (oneDNN's hint; any row count works)."""


def available() -> bool:
    """Whether this torch has oneDNN and the packed linear operators."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_MODULES: list[weakref.ref] = []
"""The packed modules by index: the compiled graph names a module by its index, so the packed
weight (a oneDNN-layout tensor the compiler cannot trace) never enters the graph."""


def _matmul(module: nn.Linear, x2d: torch.Tensor) -> torch.Tensor:
    stack = _row_split_ops() if x2d.dtype == torch.bfloat16 else None
    if stack is not None:  # the decoder-layer stack's rule (row chunks, the small-pass copy)
        return stack.linear(x2d, module.packed_weight, module.bias, module.small_weight)
    return torch.ops.mkldnn._linear_pointwise(
        x2d.contiguous(), module.packed_weight, module.bias, "none", [], ""
    )


@functools.cache
def _row_split_ops():
    """``torch.ops.fuseserve_stack`` where it builds here, else None: its ``linear`` runs a long bf16
    pass as one row chunk per thread (``kernels/cpu_stack.cpp``), the same calls the C++ layer stack
    makes, so the Python layers and the stack stay bit-identical."""
    from fuseserve.kernels import cpu_stack

    return cpu_stack.load() if cpu_stack.available() else None


@torch.library.custom_op("fuseserve::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, index: int) -> torch.Tensor:
    """``x [T, in]`` times module ``index``'s packed weight → ``[T, out]`` (one opaque call when compiled)."""
    return _matmul(_MODULES[index](), x)


@_packed_linear_op.register_fake
def _(x, index):
    return x.new_empty((x.shape[0], _MODULES[index]().out_features))


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` → ``[..., out]`` through the packed weight."""
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.fuseserve.packed_linear(x2d, self.packed_index)
    else:
        y = _matmul(self, x2d)
    return y.reshape(*shape[:-1], y.shape[-1])


def _small_copy(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` packed into ``kernels/cpu_linear.py``'s blocks for passes of at most 32 rows (bf16, AMX, the
    C++ stack present, ``FUSESERVE_AMX_LINEAR`` not 0), else None. A second copy of the weight (``prepack``
    makes them while they fit in a quarter of the RAM available): it reads a decode pass's weights
    20-25% faster than oneDNN's matmul, which stays the faster one for long passes
    (``benchmarks/README.md``)."""
    if w.dtype != torch.bfloat16 or _row_split_ops() is None:
        return None
    from fuseserve.kernels import cpu_linear

    return cpu_linear.pack(w) if cpu_linear.packable(w) else None


def _memory_available() -> int:
    """Bytes of RAM available now (``/proc/meminfo``'s MemAvailable; 0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(ln for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bfloat16 where this CPU multiplies it natively (oneDNN's own check)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def prepack(model: nn.Module, max_rows: int = 0, max_seqs: int = 0) -> int:
    """Pack the weights of ``model``'s CPU ``nn.Linear`` modules (float32; bfloat16 where native);
    returns how many were packed. With ``max_rows`` (the most tokens a pass holds) and ``max_seqs``
    (the most sequences, the LM head's rows), bf16 matmuls are then built for every row count a pass
    can run at (``warm_up``).

    Call once, after the weights are loaded; only a single-rank model (each module's ``forward`` of a
    tensor-parallel layer reduces across ranks, which the packed path does not).
    """
    if not available():
        return 0
    from fuseserve.worker.models.layers import MergedLinear
    from fuseserve.worker.parallel import ParallelLMHead, RowParallelLinear

    plain = (nn.Linear, MergedLinear, RowParallelLinear, ParallelLMHead)  # not quantized subclasses
    shared = _shared_weights(model)
    dtypes = _packable_dtypes()
    spare = _memory_available() // 4  # what the small-pass copies may take
    packed = copies = 0
    for module in model.modules():
        if type(module) not in plain or not isinstance(module.weight, torch.Tensor):
            continue
        w = module.weight
        if w.dtype not in dtypes or w.device.type != "cpu" or w.dim() != 2:
            continue
        module.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(w.detach(), BATCH_HINT), persistent=False
        )
        small = _small_copy(w) if w.numel() * w.element_size() <= spare else None
        if small is not None:
            spare -= small.numel() * small.element_size()
            copies += 1
        module.register_buffer("small_weight", small, persistent=False)
        module.packed_index = len(_MODULES)
        _MODULES.append(weakref.ref(module))
        module.forward = types.MethodType(_packed_forward, module)
        if w.data_ptr() not in shared:
            # the packed copy replaces it: the weights' size in memory (twice it with small-pass copies)
            module.weight = None
        packed += 1
    log.info(
        "prepacked %d linear layers for oneDNN (%s, CPU), %d with a small-pass copy (kernels/cpu_linear.py)",
        packed, ", ".join(map(str, dtypes)), copies,
    )  # fmt: skip
    if max_rows:
        warm_up(model, max_rows, max_seqs or max_rows)
    return packed


WARM_UP_BUDGET_S = 3.0
"""``warm_up`` builds row counts in ascending order for at most this long: each count costs a pass of
that many rows' matmuls, which for a large model on few cores outweighs the few milliseconds of the
build it saves (SmolLM2 takes 0.4 s for all of them)."""


def padded_row_counts(max_rows: int) -> list[int]:
    """Every row count a bf16 pass of 1 to ``max_rows`` tokens runs its linears at (``cpu_stack.cpp``'s
    ``padded_rows``), ascending; empty where the stack operator does not build."""
    stack = _row_split_ops()
    if stack is None:
        return []
    return sorted({stack.padded_rows(t, torch.bfloat16) for t in range(1, max_rows + 1)})


def warm_up(model: nn.Module, max_rows: int, max_head_rows: int) -> float:
    """Run each distinct bf16 packed weight shape of ``model`` once at every padded row count up to
    ``max_rows`` (``cpu_stack.cpp``'s ``padded_rows``: each count to 16, then multiples of 16 to 256
    rows, 32 to 512, 64 to 1024, 128 beyond), the LM head (the widest output) up to ``max_head_rows``,
    so oneDNN builds those matmuls now rather than in a request's pass (4-7 ms per projection and
    count at ~1000 rows on an AMX CPU), for at most ``WARM_UP_BUDGET_S``. Returns the seconds it took
    (0 without bf16 packed weights or the stack operator)."""
    stack = _row_split_ops()
    shapes = {}
    for m in model.modules():
        w = getattr(m, "packed_weight", None)
        if w is not None and w.dtype == torch.bfloat16:
            shapes.setdefault((m.in_features, m.out_features, m.bias is not None), m)
    if stack is None or not shapes:
        return 0.0
    rows = padded_row_counts(max_rows)
    head = max(shapes, key=lambda s: s[1])
    t0 = time.perf_counter()
    built = 0
    with torch.inference_mode():
        for n in rows:
            if time.perf_counter() - t0 > WARM_UP_BUDGET_S:
                break
            for (in_features, out_features, bias), m in shapes.items():
                if (in_features, out_features, bias) != head or n <= max_head_rows:
                    x = torch.zeros(n, in_features, dtype=torch.bfloat16)
                    stack.linear(x, m.packed_weight, m.bias, m.small_weight)
            built += 1
    seconds = time.perf_counter() - t0
    log.info(
        "built bf16 matmuls for %d of %d row counts x %d shapes in %.1f s%s", built, len(rows), len(shapes),
        seconds, "" if built == len(rows) else " (the rest on first use)",
    )  # fmt: skip
    return seconds


def _shared_weights(model: nn.Module) -> set[int]:
    """Data pointers of parameters held by more than one module (tied embeddings)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[p.data_ptr()] = seen.get(p.data_ptr(), 0) + 1
    return {ptr for ptr, n in seen.items() if n > 1}
