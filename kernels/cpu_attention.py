"""CPU paged ragged attention: a C++ operator compiled at first use, and its attention backend.

``cpu_attention.cpp`` attends every query of a SplitFuse pass (prefill chunks and decode tokens, one
call) to its keys where they lie in the paged cache: it walks each sequence's block table, widens one
block of K/V at a time to fp32, and keeps flash-attention's running max and sum (online softmax) for
a prefill tile; decode rows read every KV head of a cache row together and take their softmax in two
passes over the keys (the source's header says how). Nothing is gathered or copied per layer. The reference (``kernels/reference.py``) copies each
sequence's whole K/V out of the cache per layer and loops over prefill chunks in Python.

Build: at first use, ``c++`` (or ``$CXX``) compiles the source against torch's headers
(``torch.utils.cpp_extension.include_paths()``) with ``-O3 -march=native -fopenmp`` into
``~/.cache/fuseserve/extensions/`` (``$FUSESERVE_EXTENSIONS_DIR`` overrides); the file name carries
a hash of the source, the flags, the torch version and the CPU's model and flags, so a rebuilt or
moved cache never loads a library built for another CPU or torch. About 30-60 s on 2 cores, once.
No ninja and no pybind11 are needed: the operator registers itself with ``TORCH_LIBRARY`` and loads
with ``torch.ops.load_library``. Without a compiler ``load()`` raises ``CpuKernelUnavailable`` with
the reason; ``get_backend("auto")`` then falls back to the reference and says so once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from fuseserve.kernels import kv_quant, reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
OP_NAMESPACE = "fuseserve_cpu"


class CpuKernelUnavailable(RuntimeError):
    """The C++ CPU attention operator cannot be built or loaded here (the message says why)."""


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (``-march=native`` builds are valid only on a match)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags


def _library_path(cxx: str) -> Path:
    root = Path(
        os.environ.get("FUSESERVE_EXTENSIONS_DIR", Path.home() / ".cache" / "fuseserve" / "extensions")
    )
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_flags()).encode(), torch.__version__.encode(), cxx.encode()):
        h.update(part)
    h.update(_cpu_signature().encode())
    return root / f"fuseserve_cpu_attention_{h.hexdigest()[:16]}.so"


def _compile(cxx: str, target: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [cxx, *_flags(), str(SOURCE), "-o", str(partial)]
        cmd += [f"-I{p}" for p in include_paths()]
        cmd += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        log.info("building the CPU attention operator (once): %s", " ".join(cmd[:3]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CpuKernelUnavailable(f"{cxx} failed to build {SOURCE.name}:\n{proc.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file


@functools.cache
def load() -> Any:
    """``torch.ops.fuseserve_cpu``, building the library first if no cached build exists.

    Raises ``CpuKernelUnavailable`` when no C++ compiler is on PATH or the build fails.
    """
    cxx = os.environ.get("CXX", "c++")
    found = shutil.which(cxx)
    target = _library_path(cxx)
    if not target.exists():
        if found is None:
            raise CpuKernelUnavailable(
                f"no C++ compiler ({cxx!r}) on PATH: install g++ (e.g. apt-get install g++) or set CXX; "
                "until then the CPU path uses the PyTorch reference attention"
            )
        _compile(found, target)
    try:
        torch.ops.load_library(str(target))
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot load {target}: {e}") from e
    return getattr(torch.ops, OP_NAMESPACE)


def available() -> bool:
    """Whether the operator builds and loads here (the first call may compile it)."""
    try:
        load()
    except CpuKernelUnavailable:
        return False
    return True


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


class CpuAttentionMetadata:
    """Per-pass inputs of the C++ operator: the batch's own int32 tensors, made contiguous once."""

    def __init__(self, slot_mapping, block_tables, cu_seqlens_q, seq_lens):
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()


def plan(batch: Any) -> CpuAttentionMetadata:
    """Metadata for one pass of a ``RaggedBatch`` (no Python loop over sequences)."""
    tables = batch.block_tables
    if tables.shape[1] == 0:  # an empty pass still needs a 2-D table
        tables = tables.new_zeros((tables.shape[0], 1))
    return CpuAttentionMetadata(batch.slot_mapping, tables, batch.cu_seqlens_q, batch.seq_lens)


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
    written and read with ``k_scale`` / ``v_scale``)."""
    reference.write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seq_lens,
        scale,
        sliding_window,
        soft_cap,
        k_scale,
        v_scale,
    )
    return out.flatten(1)
