"""Devices, dtypes and memory sizes: what a worker runs on, resolved once from the options.

``resolve_device`` / ``parse_dtype`` turn ``EngineConfig.device`` / ``dtype`` into torch's (bf16 by
default only where the CPU has native BF16 instructions: ``cpu_has_bf16``); ``parse_memory`` reads
``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or a plain number of bytes.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fuseserve.errors import InvalidParameterError

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: a simulated worker never does
    import torch

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(value: int | float | str) -> int:
    """Bytes from ``value``: a number of bytes or a string such as ``"512MiB"`` / ``"2GiB"``.

    Raises ``InvalidParameterError`` on anything else or a non-positive size.
    """
    if isinstance(value, int | float):
        size = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise InvalidParameterError("kv_cache_memory", value, "bytes or a size like '512MiB', '2GiB'")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise InvalidParameterError("kv_cache_memory", value, "> 0 bytes")
    return size


def default_device() -> torch.device:
    """CUDA when a GPU is visible, else CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``None`` → ``default_device()``; else the named device, checked to exist here.

    Raises ``InvalidParameterError("device", ...)`` for an unknown name or a GPU that is not visible.
    """
    import torch

    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise InvalidParameterError("device", name, "cpu, cuda or cuda:N") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise InvalidParameterError("device", name, "cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidParameterError("device", name, "cpu (no CUDA GPU is visible here)")
    if device.index is not None and device.index >= count:
        raise InvalidParameterError("device", name, f"cuda:0 .. cuda:{count - 1}")
    return device


CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # x86 bf16 dot-product / tile instructions


@functools.cache
def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 matmuls natively: x86 ``avx512_bf16`` or ``amx_bf16`` in the
    ``flags`` of ``/proc/cpuinfo`` (the test vLLM's CPU backend uses), or Arm's ``bf16`` feature.
    False where the file cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and CPU_BF16_FLAGS & set(value.split()):
            return True
        if key.strip() == "Features" and "bf16" in value.split():
            return True
    return False


def default_dtype(device: torch.device) -> torch.dtype:
    """The ``--dtype auto`` choice: bf16 on CUDA (fp16 where the GPU lacks bf16); on CPU bf16 where
    the CPU has bf16 instructions (``cpu_has_bf16``), else fp32 (``--dtype float32`` forces fp32)."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None → ``default_dtype``; else ``float32``/``fp32``/``bfloat16``/``bf16``/``float16``/``fp16``."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return default_dtype(device)
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise InvalidParameterError("dtype", name, "auto, float32, bfloat16 or float16")
    return table[name]
