"""bf16 linears in cpu_linear.cpp's 64-column blocks (kernels/cpu_linear.py): as accurate as oneDNN's
packed matmul against fp32, the same bits up to 16 rows, refused where the shape or the CPU does not
fit; prepack gives decode-size passes the copy (services/worker/prepacked_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fuseserve.kernels import cpu_linear, cpu_stack
from fuseserve.worker import prepacked_linear

pytestmark = pytest.mark.skipif(
    not (prepacked_linear.available() and cpu_stack.available() and cpu_linear.available()),
    reason="no oneDNN bf16 brgemm here (AMX) or no C++ compiler: oneDNN's packed matmul serves every pass",
)


@pytest.mark.parametrize("shape", [(960, 576), (208, 64), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 32, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_match_onednn_against_fp32(shape, rows, with_bias):
    torch.manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k, dtype=torch.bfloat16) / 8
    bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    ours = cpu_linear.linear(x, cpu_linear.pack(w), bias)
    onednn = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(w, 64), bias, "none", [], ""
    )
    exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    err, ref_err = (ours.float() - exact).abs(), (onednn.float() - exact).abs()
    assert err.mean() <= ref_err.mean() * 1.05 + 1e-6
    assert err.max() <= ref_err.max() * 2 + 1e-6  # one bf16 step at most where the sums round apart
    if rows <= 16:
        assert torch.equal(ours, onednn)


def test_refuses_what_it_cannot_multiply():
    w = torch.randn(64, 48, dtype=torch.bfloat16)  # K not a multiple of 32
    assert not cpu_linear.packable(w) and not cpu_linear.packable(torch.randn(64, 64))  # nor fp32
    with pytest.raises(RuntimeError, match="K % 32"):
        cpu_linear.pack(w)
    packed = cpu_linear.pack(torch.randn(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"x \[T, K\]"):
        cpu_linear.linear(torch.randn(3, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_linear.linear(
            torch.randn(3, 64, dtype=torch.bfloat16), packed, torch.randn(63, dtype=torch.bfloat16)
        )


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(64, 40, bias=False)  # N % 16 != 0: oneDNN only


def test_prepack_gives_decode_passes_the_copy(monkeypatch):
    torch.manual_seed(0)
    model = Mlp().to(torch.bfloat16)
    w, b = model.up.weight.detach().clone(), model.up.bias.detach().clone()
    prepacked_linear.prepack(model)
    assert model.up.small_weight is not None and model.odd.small_weight is None
    stack = cpu_stack.load()
    for rows in (1, 16, 32, 33, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        y = model.up(x)
        onednn = stack.linear(x, model.up.packed_weight, model.up.bias)  # no copy: oneDNN at any row count
        assert (y.float() - F.linear(x.float(), w.float(), b.float())).abs().max() < 0.1
        if rows <= 16 or rows > 32:
            assert torch.equal(y, onednn)  # the copy's bits at decode sizes; oneDNN's beyond 32 rows
    monkeypatch.setattr(cpu_linear, "ENABLED", False)
    off = Mlp().to(torch.bfloat16)
    prepacked_linear.prepack(off)
    assert off.up.small_weight is None
