"""Engine configuration shared by the pipeline, the scheduler and the workers.

Sizes are in tokens unless named ``*_bytes``; memory strings accept ``"512MiB"``, ``"2GiB"``,
``"1.5GB"`` or a plain number of bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fuseserve.errors import InvalidParameterError

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
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``None`` → ``default_device()``; else the named device, checked to exist here.

    Raises ``InvalidParameterError("device", ...)`` for an unknown name or a GPU that is not visible.
    """
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


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU; bf16 on CUDA (fp16 where the GPU lacks bf16)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/None → ``default_dtype``; else ``float32``/``fp32``/``bfloat16``/``bf16``/``float16``/``fp16``."""
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


@dataclass
class EngineConfig:
    """Knobs of one engine (pipeline) or one scheduler + its workers.

    token_budget: max tokens per forward pass (None → chosen by profiling the device).
    max_num_seqs: max sequences per pass.
    block_size: tokens per KV-cache block.
    kv_cache_memory: bytes for K and V of all layers on one worker (None → a default by device).
    watermark_blocks: blocks kept free at admission (SplitFuse rule 2).
    max_preemptions: preemptions allowed per sequence before it may no longer be preempted.
    policy: "splitfuse" | "prefill_first" | "whole_prompt".
    overlap: build and send each worker's next plan while its current pass runs (at most one plan
        queued per worker); False runs one plan at a time per worker.
    """

    token_budget: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    watermark_blocks: int = 1
    max_preemptions: int = 4
    policy: str = "splitfuse"
    overlap: bool = True
    device: str | None = None
    dtype: str | None = None

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` for an out-of-range field."""
        if self.token_budget is not None and self.token_budget < 1:
            raise InvalidParameterError("token_budget", self.token_budget, ">= 1 or None")
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", self.max_num_seqs, ">= 1")
        if self.block_size < 1:
            raise InvalidParameterError("block_size", self.block_size, ">= 1")
        if self.policy not in ("splitfuse", "prefill_first", "whole_prompt"):
            raise InvalidParameterError("policy", self.policy, "splitfuse, prefill_first, whole_prompt")
        if self.watermark_blocks < 0:
            raise InvalidParameterError("watermark_blocks", self.watermark_blocks, ">= 0")
        if self.max_preemptions < 0:
            raise InvalidParameterError("max_preemptions", self.max_preemptions, ">= 0")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
