"""Builds and loads fuseserve's C++ CPU operators (``cpu_attention.cpp``, ``cpu_quant_linear.cpp``,
``cpu_fused.cpp``): one place for the compiler call, the cache and the errors.

At first use ``c++`` (or ``$CXX``) compiles a source against torch's headers
(``torch.utils.cpp_extension.include_paths()``) with ``-O3 -march=native -fopenmp`` into
``~/.cache/fuseserve/extensions/`` (``$FUSESERVE_EXTENSIONS_DIR`` overrides); the file name carries a
hash of the source and the headers beside it, the flags, the torch version, the compiler and the CPU's model and flags, so a
rebuilt or moved cache never loads a library built for another CPU or torch. No ninja and no
pybind11: each source registers its operators with ``TORCH_LIBRARY`` and loads with
``torch.ops.load_library``. Without a compiler, or when the build fails, ``load`` raises
``CpuKernelUnavailable`` with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class CpuKernelUnavailable(RuntimeError):
    """A C++ CPU operator cannot be built or loaded here (the message says why)."""


def cpu_signature() -> str:
    """The CPU's model name and feature flags (``-march=native`` builds are valid only on a match)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def flags(extra: tuple[str, ...] = ()) -> list[str]:
    """The compiler flags of every operator, then ``extra`` (a source's own, e.g. ``-ffp-contract=off``)."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        out.append("-march=native")
    return out + list(extra)


def library_path(source: Path, cxx: str, extra: tuple[str, ...] = ()) -> Path:
    """Where the build of ``source`` for this CPU, torch, compiler and flags is cached."""
    root = Path(
        os.environ.get("FUSESERVE_EXTENSIONS_DIR", Path.home() / ".cache" / "fuseserve" / "extensions")
    )
    h = hashlib.sha256()
    for part in (
        source.read_bytes(),
        *(header.read_bytes() for header in sorted(source.parent.glob("*.h"))),  # cpu_vec.h
        " ".join(flags(extra)).encode(),
        torch.__version__.encode(),
        cxx.encode(),
    ):
        h.update(part)
    h.update(cpu_signature().encode())
    return root / f"fuseserve_{source.stem}_{h.hexdigest()[:16]}.so"


def _compile(source: Path, cxx: str, target: Path, extra: tuple[str, ...]) -> None:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [cxx, *flags(extra), str(source), "-o", str(partial)]
        cmd += [f"-I{p}" for p in include_paths()]
        cmd += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        log.info("building the C++ operator %s (once): %s", source.name, " ".join(cmd[:3]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CpuKernelUnavailable(f"{cxx} failed to build {source.name}:\n{proc.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file


def load(source: Path, namespace: str, extra: tuple[str, ...] = ()) -> Any:
    """``torch.ops.<namespace>`` from ``source``, building the library first if no cached build exists.

    Raises ``CpuKernelUnavailable`` when no C++ compiler is on PATH or the build or load fails.
    """
    cxx = os.environ.get("CXX", "c++")
    target = library_path(source, cxx, extra)
    if not target.exists():
        found = shutil.which(cxx)
        if found is None:
            raise CpuKernelUnavailable(
                f"no C++ compiler ({cxx!r}) on PATH: install g++ (e.g. apt-get install g++) or set CXX; "
                f"until then {source.name}'s operators are not used"
            )
        _compile(source, found, target, extra)
    try:
        torch.ops.load_library(str(target))
    except OSError as e:
        raise CpuKernelUnavailable(f"cannot load {target}: {e}") from e
    return getattr(torch.ops, namespace)


def loads(load_fn: Callable[[], Any], what: str = "", level: int = logging.INFO) -> bool:
    """Whether ``load_fn()`` (a source's ``load``) builds and loads its operators here; when it cannot
    and ``what`` names them, the reason is logged at ``level``."""
    try:
        load_fn()
    except CpuKernelUnavailable as e:
        if what:
            log.log(level, "%s unavailable: %s", what, e)
        return False
    return True
