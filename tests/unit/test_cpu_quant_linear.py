"""kernels/cpu_quant_linear: the C++ few-row quantized matmul against the dequantize-then-matmul
reference (skipped where no C++ compiler builds it)."""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import cpu_quant_linear as cq
from fuseserve.kernels import quant_linear as ql

pytestmark = pytest.mark.skipif(not cq.available(), reason="the C++ operator does not build here")


def _weight(n, k, bits, group, seed=0) -> ql.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = torch.randint(0, 2**bits, scale.shape, generator=gen).float()
    return ql.QuantizedWeight(q, scale, -scale * zero, bits, group)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 32), (2, 64)])
@pytest.mark.parametrize("rows", [1, 3, 6, 13, cq.SMALL_ROWS, cq.SMALL_ROWS + 5])
def test_matches_reference(bits, group, rows):
    w = _weight(37, 256, bits, group)
    kernel = ql.pack(w, torch.float32, torch.device("cpu"), kernel="cpu_gemv")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    want = ql.reference_linear(x, w)
    assert ((kernel(x) - want).norm() / want.norm()) < 1e-5


def test_is_a_cpu_candidate_and_refuses_small_groups():
    assert "cpu_gemv" in ql.candidates(_weight(32, 64, 4, 32), torch.device("cpu"))
    assert "cpu_gemv" not in ql.candidates(_weight(32, 64, 4, 16), torch.device("cpu"))


def test_bf16_activations_compute_in_fp32():
    w = _weight(32, 64, 4, 32)
    kernel = ql.pack(w, torch.bfloat16, torch.device("cpu"), kernel="cpu_gemv")
    x = torch.randn(2, 64).bfloat16()
    got = kernel(x)
    assert got.dtype == torch.bfloat16
    want = ql.reference_linear(x.float(), w)
    assert ((got.float() - want).norm() / want.norm()) < 1e-2
