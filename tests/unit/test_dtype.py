"""``--dtype auto``: bf16 on CPUs with bf16 instructions (``/proc/cpuinfo`` flags), fp32 one flag away."""

from __future__ import annotations

import pytest
import torch

from fuseserve import device
from fuseserve.cli import build_parser
from fuseserve.errors import InvalidParameterError

X86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f {extra} rdrand\n"


@pytest.mark.parametrize(
    "text,expected",
    [
        (X86.format(extra="avx512_bf16"), True),
        (X86.format(extra="amx_bf16 amx_tile"), True),
        (X86.format(extra="avx512_vnni"), False),
        ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),  # Arm
        ("processor\t: 0\nFeatures\t: fp asimd\n", False),
    ],
)
def test_cpu_has_bf16_reads_cpuinfo_flags(tmp_path, text, expected):
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    assert device.cpu_has_bf16(f) is expected


def test_cpu_has_bf16_without_cpuinfo(tmp_path):
    assert device.cpu_has_bf16(tmp_path / "missing") is False


@pytest.mark.parametrize("has_bf16,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_cpu_and_float32_is_one_flag_away(monkeypatch, has_bf16, want):
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: has_bf16)
    cpu = torch.device("cpu")
    assert device.parse_dtype("auto", cpu) == want
    assert device.parse_dtype(None, cpu) == want
    assert device.parse_dtype("float32", cpu) == torch.float32
    assert device.parse_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(InvalidParameterError):
        device.parse_dtype("int8", cpu)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_passes_dtype(command):
    args = ["generate", "hi"] if command == "generate" else ["serve"]
    assert build_parser().parse_args([*args, "--dtype", "float32"]).dtype == "float32"
    assert build_parser().parse_args(args).dtype is None  # auto
