"""kernels/triton_quant_linear.py against the dequantize-then-matmul reference (on the CPU with
``TRITON_INTERPRET=1``, which tests/conftest.py sets where no GPU is visible; compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import quant_linear as ql

tq = pytest.importorskip("fuseserve.kernels.triton_quant_linear")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, bits, group, seed=0) -> ql.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = torch.randint(0, 2**bits, scale.shape, generator=gen).float()
    return ql.QuantizedWeight(q, scale, -scale * zero, bits, group)


@pytest.mark.parametrize(
    "bits,group,n,k,m", [(4, 32, 48, 64, 1), (4, 64, 40, 128, 20), (8, 32, 33, 96, 5), (2, 32, 32, 64, 3)]
)
def test_matches_reference(bits, group, n, k, m):
    w = _weight(n, k, bits, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = ql.reference_linear(x, w)
    packed = tq.pack_weight(w)
    assert packed.shape == ((n, k // 2) if bits <= 4 else (n, k))
    got = tq.quant_matmul(
        x.to(DEVICE), packed.to(DEVICE), w.scale.to(DEVICE), w.offset.to(DEVICE), bits, group
    ).cpu()
    assert got.shape == (m, n)
    assert ((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize(
    "bits,group,n,k,m",
    [
        (4, 128, 64, 512, 3),  # K steps of 128, K split in 4
        (4, 64, 70, 192, 16),  # steps of 64, 3 splits, a partial output tile
        (4, 32, 48, 96, 1),  # steps of 32
        (8, 128, 33, 256, 5),
        (2, 32, 32, 64, 2),
        (4, 256, 40, 256, 4),  # one group per row (group = K)
        (4, 128, 64, 512, 20),  # beyond 16 rows: the plain tiles
    ],
)
def test_split_k_matches_reference(bits, group, n, k, m):
    """The decode tiles (``split_k``): wider K steps, K split over programs, partials summed."""
    w = _weight(n, k, bits, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = ql.reference_linear(x, w)
    args = (x.to(DEVICE), tq.pack_weight(w).to(DEVICE), w.scale.to(DEVICE), w.offset.to(DEVICE), bits, group)
    got = tq.quant_matmul(*args, split_k=True).cpu()
    assert ((got - want).norm() / want.norm()) < 1e-5
    assert torch.equal(got, tq.quant_matmul(*args, split_k=True).cpu())  # fixed-order sum: same bits


def test_decode_config():
    """64 outputs a program; the widest step dividing K and the group; splits up to the programs wanted."""
    assert tq.decode_config(4096, 4096, 128, 528) == (64, 128, 9)  # 64 output tiles x 9 = 576 programs
    assert tq.decode_config(4096, 11008, 128, 528) == (64, 128, 9)
    assert tq.decode_config(22016, 4096, 128, 528) == (64, 128, 2)
    assert tq.decode_config(4096, 4096, 64, 528) == (64, 64, 9)
    assert tq.decode_config(64, 96, 32, 528) == (64, 32, 3)  # no more splits than K steps
    assert tq.decode_config(4096, 4096, 128, 8) == (64, 128, 1)
    assert tq.decode_config(64, 8192, 128, 100000) == (64, 128, 16)  # at most 16


def test_nibble_layout():
    """Byte j of a 32-value block: value j low, value 16 + j high."""
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    w = ql.QuantizedWeight(q, torch.ones(1, 1), torch.zeros(1, 1), 4, 32)
    packed = tq.pack_weight(w)[0]
    assert packed[0].item() == (0 | (0 << 4)) and packed[5].item() == (5 | (5 << 4))
    q2 = torch.cat([torch.zeros(16), torch.full((16,), 3.0)]).to(torch.uint8).view(1, 32)
    assert (
        tq.pack_weight(ql.QuantizedWeight(q2, torch.ones(1, 1), torch.zeros(1, 1), 4, 32))[0, 0].item()
        == 0x30
    )


def test_refuses_groups_below_32():
    w = _weight(32, 64, 4, 16)
    with pytest.raises(ValueError, match="multiples of 32"):
        tq.quant_matmul(torch.randn(1, 64), tq.pack_weight(_weight(32, 64, 4, 32)), w.scale, w.offset, 4, 16)
    assert not tq.TritonQuantLinear.accepts(w, torch.device("cuda"))


def test_as_a_quant_linear_kernel():
    """Through ``PackedLinear``: leading dims, an act-order permutation, the compute dtype."""
    w = _weight(64, 128, 4, 32)
    w.perm = torch.randperm(128, generator=torch.Generator().manual_seed(2))
    kernel = tq.TritonQuantLinear(w, torch.float32).to(torch.device(DEVICE))
    x = torch.randn(2, 3, 128)
    got = kernel(x.to(DEVICE)).cpu()
    want = ql.reference_linear(x.reshape(6, 128), w).view(2, 3, 64)
    assert ((got - want).norm() / want.norm()) < 1e-5
    assert "triton" not in ql.candidates(w, torch.device("cpu"))
    split = tq.TritonQuantLinearSplitK(w, torch.float32).to(torch.device(DEVICE))
    assert ((split(x.to(DEVICE)).cpu() - want).norm() / want.norm()) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chosen_on_cuda_in_16_bit(dtype):
    """On a GPU the Triton kernel is a candidate, and packed W4A16 / W8A16 matches the reference."""
    for bits in (4, 8):
        w = _weight(4096, 4096, bits, 128)
        assert {"triton", "triton-splitk"} <= set(ql.candidates(w, torch.device("cuda")))
        kernel = ql.pack(w, dtype, torch.device("cuda"), kernel="triton")
        x = torch.randn(16, 4096, device="cuda", dtype=dtype)
        want = ql.reference_linear(
            x.float(), ql.QuantizedWeight(w.q.cuda(), w.scale.cuda(), w.offset.cuda(), bits, 128)
        )
        got = kernel(x).float()
        assert ((got - want).norm() / want.norm()) < 2e-2
