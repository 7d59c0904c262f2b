"""kernels/quant_linear.py: every packed kernel against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import quant_linear as ql


def _weight(n, k, bits, group, seed=0, symmetric=False, permuted=False) -> ql.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = (
        torch.full_like(scale, 2 ** (bits - 1))
        if symmetric
        else torch.randint(0, 2**bits, scale.shape, generator=gen).float()
    )
    perm = torch.randperm(k, generator=gen) if permuted else None
    return ql.QuantizedWeight(q, scale, -scale * zero, bits, group, perm)


def _check(kernel: ql.PackedLinear, w: ql.QuantizedWeight, rtol=1e-4):
    for m in (1, 5, 16):
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
        want = ql.reference_linear(x, w)
        got = kernel(x)
        assert got.shape == want.shape
        err = ((got - want).norm() / want.norm()).item()
        assert err < rtol, (kernel.name, m, err)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (2, 32), (4, 256)])
def test_int4pack_matches_reference(bits, group):
    w = _weight(64, 256, bits, group)
    assert "int4pack" in ql.candidates(w, torch.device("cpu"))
    _check(ql.pack(w, torch.float32, torch.device("cpu"), kernel="int4pack"), w)


def test_int4pack_regroups_a_per_channel_weight():
    w = _weight(48, 192, 4, 192)  # per channel; 192 = 3 * 64
    kernel = ql.pack(w, torch.float32, torch.device("cpu"), kernel="int4pack")
    assert kernel.group == 64
    _check(kernel, w)


@pytest.mark.parametrize("bits,group", [(8, 32), (6, 64), (8, 128)])
def test_int4pack_x2_is_exact_for_wider_weights(bits, group):
    w = _weight(48, 256, bits, group)
    _check(ql.pack(w, torch.float32, torch.device("cpu"), kernel="int4pack_x2"), w)


def test_int4pack_needs_rows_in_sixteens():
    assert "int4pack" not in ql.candidates(_weight(40, 256, 4, 32), torch.device("cpu"))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8pack_per_channel_with_and_without_offset(symmetric):
    w = _weight(40, 96, 8, 96, symmetric=symmetric)
    kernel = ql.pack(w, torch.float32, torch.device("cpu"), kernel="int8pack")
    assert kernel.has_correction is not symmetric
    _check(kernel, w)


def test_int8pack_refuses_groups():
    w = _weight(40, 96, 8, 32)
    assert "int8pack" not in ql.candidates(w, torch.device("cpu"))
    with pytest.raises(ValueError, match="int8pack"):
        ql.pack(w, torch.float32, torch.device("cpu"), kernel="int8pack")


@pytest.mark.parametrize("bits,group", [(4, 16), (3, 32), (6, 16), (8, 32)])
def test_dequant_kernel_any_format(bits, group):
    w = _weight(24, 64, bits, group, symmetric=bits == 3)
    kernel = ql.pack(w, torch.float32, torch.device("cpu"), kernel="dequant")
    _check(kernel, w, rtol=1e-6)
    want = w.q.numel() * (0.5 if bits <= 4 else 1) + 8 * w.scale.numel()
    assert kernel.nbytes() == want


def test_reference_is_the_dequantized_matmul():
    """The reference itself against a hand-written W[n, k] = q * s + offset (groups along k)."""
    w = _weight(8, 64, 4, 16)
    dense = torch.empty(8, 64)
    for n in range(8):
        for k in range(64):
            dense[n, k] = w.q[n, k].float() * w.scale[n, k // 16] + w.offset[n, k // 16]
    x = torch.randn(3, 64)
    torch.testing.assert_close(ql.reference_linear(x, w), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_act_order_permutation():
    """A permuted (act-order) weight multiplies x's columns in ``perm`` order, every kernel alike."""
    w = _weight(64, 128, 4, 32, permuted=True)
    x = torch.randn(4, 128)
    torch.testing.assert_close(
        ql.reference_linear(x, w), x @ w.dequantize_unpermuted().T, rtol=1e-4, atol=1e-4
    )
    for name in ql.candidates(w, torch.device("cpu")):
        _check(ql.pack(w, torch.float32, torch.device("cpu"), kernel=name), w)


def test_bf16_compute():
    w = _weight(64, 128, 4, 32)
    x = torch.randn(4, 128)
    want = ql.reference_linear(x, w)
    for name in ql.candidates(w, torch.device("cpu")):
        got = ql.pack(w, torch.bfloat16, torch.device("cpu"), kernel=name)(x.bfloat16()).float()
        assert ((got - want).norm() / want.norm()) < 2e-2, name


def test_rows_columns_and_cat():
    w = _weight(32, 128, 4, 32)
    top, bottom = w.rows(0, 20), w.rows(20, 12)
    torch.testing.assert_close(ql.QuantizedWeight.cat_rows([top, bottom]).dequantize(), w.dequantize())
    torch.testing.assert_close(w.columns(64, 64).dequantize(), w.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="groups of 32"):
        w.columns(16, 64)
    per_channel = _weight(16, 96, 8, 96)
    torch.testing.assert_close(per_channel.columns(40, 24).dequantize(), per_channel.dequantize()[:, 40:64])


def test_shape_mismatch_is_refused():
    q = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        ql.QuantizedWeight(q, torch.ones(8, 3), torch.zeros(8, 3), 4, 16)


def test_choose_kernel_picks_a_correct_candidate():
    w = _weight(64, 256, 4, 32)
    name = ql.choose_kernel(w, torch.float32, torch.device("cpu"))
    assert name in ql.candidates(w, torch.device("cpu"))
    _check(ql.pack(w, torch.float32, torch.device("cpu")), w)


def test_fp8_weight():
    w = torch.randn(16, 32)
    scale = w.abs().amax(dim=1) / 448.0
    w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    kernel = ql.FP8Weight(w8, scale, torch.float32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(kernel(x), x @ (w8.float() * scale[:, None]).T, rtol=1e-5, atol=1e-5)
    assert kernel.nbytes() == 16 * 32 + 16 * 4


def test_dequant_rows_are_an_embedding_lookup():
    w = _weight(50, 64, 4, 32)
    kernel = ql.pack(w, torch.float32, torch.device("cpu"), kernel="dequant")
    ids = torch.tensor([3, 0, 49, 3])
    torch.testing.assert_close(kernel.rows(ids), w.dequantize()[ids])


def test_float8_weight_rows_and_pack():
    w8 = torch.randn(32, 16).to(torch.float8_e4m3fn)
    fw = ql.Float8Weight(w8, torch.rand(32) + 0.5)
    both = ql.Float8Weight.cat_rows([fw.rows(0, 10), fw.rows(10, 22)])
    torch.testing.assert_close(both.dequantize(), fw.dequantize())
    x = torch.randn(2, 16)
    kernel = ql.pack(fw, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(kernel(x), x @ fw.dequantize().T, rtol=1e-5, atol=1e-5)
