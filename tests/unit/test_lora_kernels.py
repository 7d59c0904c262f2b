"""Multi-adapter LoRA kernels against the token-by-token reference (``kernels/lora_reference.py``):
the CPU grouped path, and the Triton SGMV shrink/expand pair (on the CPU with ``TRITON_INTERPRET=1``,
which tests/conftest.py sets where no GPU is visible; compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from fuseserve.kernels import lora_reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (segment lengths, slots): base (-1) between adapters, a slot twice, one-token (decode) segments
CASES = [
    ([5, 16, 1, 1, 30, 3], [0, -1, 2, 0, 1, -1]),
    ([1, 1, 1, 1], [3, -1, 3, 1]),
    ([40], [1]),
    ([7, 9], [-1, -1]),
]


def _weights(slots: int, k_in: int, k: int, out: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, k_in, k, generator=g).to(dtype)
    b = (torch.randn(slots, k, out, generator=g) * 0.1).to(dtype)
    return a, b


def _token_slots(lengths: list[int], slots: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))


def _groups(token_slots: torch.Tensor) -> list[tuple[int, object]]:
    return [
        (int(s), torch.nonzero(token_slots == s).flatten()) for s in token_slots.unique().tolist() if s >= 0
    ]


def test_reference_is_per_token_matmul():
    a, b = _weights(2, 8, 4, 6)
    x = torch.randn(3, 8)
    slots = torch.tensor([1, -1, 0])
    y = torch.zeros(3, 6)
    ref.expand_reference(ref.shrink_reference(x, a, slots), b, slots, y)
    torch.testing.assert_close(y[0], x[0] @ a[1] @ b[1])
    assert torch.equal(y[1], torch.zeros(6))
    torch.testing.assert_close(y[2], x[2] @ a[0] @ b[0])


@pytest.mark.parametrize("lengths,slots", CASES)
def test_grouped_cpu_path_matches_reference(lengths, slots):
    a, b = _weights(4, 64, 24, 48)
    token_slots = _token_slots(lengths, slots)
    x = torch.randn(len(token_slots), 64)
    base = torch.randn(len(token_slots), 48)
    want = ref.expand_reference(ref.shrink_reference(x, a, token_slots), b, token_slots, base.clone())
    got = ref.grouped_delta(x, a, b, _groups(token_slots), base.clone())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a contiguous slot's rows may come as a slice
    got_slice = ref.grouped_delta(x[:5], a, b, [(0, slice(0, 5))], base[:5].clone())
    torch.testing.assert_close(got_slice, base[:5] + x[:5] @ a[0] @ b[0], atol=1e-5, rtol=1e-5)


tl_lora = pytest.importorskip("fuseserve.kernels.triton_lora")


def _segments(lengths, slots):
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(lengths).cumsum(0)
    return starts.to(DEVICE), torch.tensor(slots, dtype=torch.int32).to(DEVICE)


@pytest.mark.parametrize("lengths,slots", CASES)
@pytest.mark.parametrize("k_in,k,out", [(64, 24, 48), (40, 48, 100)])
def test_triton_shrink_expand_match_reference(lengths, slots, k_in, k, out):
    """Ranks not a power of two, feature sizes not multiples of the tiles, base segments skipped."""
    a, b = _weights(4, k_in, k, out)
    token_slots = _token_slots(lengths, slots)
    x = torch.randn(len(token_slots), k_in)
    starts, seg_slots = _segments(lengths, slots)
    s = tl_lora.sgmv_shrink(x.to(DEVICE), a.to(DEVICE), starts, seg_slots, max(lengths))
    want_s = ref.shrink_reference(x, a, token_slots)
    torch.testing.assert_close(s.cpu(), want_s, atol=1e-4, rtol=1e-5)
    y0 = torch.randn(len(token_slots), out)
    y = tl_lora.sgmv_expand(s, b.to(DEVICE), starts, seg_slots, max(lengths), y0.clone().to(DEVICE))
    want = ref.expand_reference(want_s, b, token_slots, y0.clone())
    torch.testing.assert_close(y.cpu(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_in_16_bit(dtype):
    lengths, slots = CASES[0]
    a, b = _weights(4, 64, 32, 48, dtype=dtype)
    token_slots = _token_slots(lengths, slots)
    x = torch.randn(len(token_slots), 64).to(dtype)
    starts, seg_slots = _segments(lengths, slots)
    y0 = torch.randn(len(token_slots), 48).to(dtype)
    s = tl_lora.sgmv_shrink(x.to(DEVICE), a.to(DEVICE), starts, seg_slots, max(lengths))
    y = tl_lora.sgmv_expand(s, b.to(DEVICE), starts, seg_slots, max(lengths), y0.clone().to(DEVICE)).cpu()
    want = ref.expand_reference(ref.shrink_reference(x, a, token_slots), b, token_slots, y0.float().clone())
    assert y.dtype == dtype
    assert ((y.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("lengths,slots", CASES + [([30, 40, 20], [2, 0, 2])])
def test_pass_metadata_cpu_path_matches_reference(lengths, slots):
    """``LoRABatch`` over chunks (adjacent chunks of a slot merged; one slot twice, apart: index
    rows) on the CPU path equals the reference."""
    from fuseserve.worker.lora_layers import LoRABatch

    a, b = _weights(4, 64, 24, 48)
    token_slots = _token_slots(lengths, slots)
    x = torch.randn(len(token_slots), 64)
    base = torch.randn(len(token_slots), 48)
    want = ref.expand_reference(ref.shrink_reference(x, a, token_slots), b, token_slots, base.clone())
    batch = LoRABatch.build(slots, lengths, torch.device("cpu"), "grouped")
    if all(s < 0 for s in slots):
        assert batch is None
        return
    assert len(batch.groups) == len(set(slots) - {-1})
    got = batch.apply(x, base.clone(), a, b, reduce=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_through_the_pass_metadata():
    """``LoRABatch.apply`` on the Triton path, ``a`` a strided view (Triton reads it in place)."""
    from fuseserve.worker.lora_layers import LoRABatch

    lengths, slots = CASES[0]
    a, b = _weights(4, 64, 24, 48)
    a_view = a.permute(1, 0, 2).contiguous().to(DEVICE).permute(1, 0, 2)  # [L, in, K], strided
    token_slots = _token_slots(lengths, slots)
    x = torch.randn(len(token_slots), 64)
    base = torch.randn(len(token_slots), 48)
    want = ref.expand_reference(ref.shrink_reference(x, a, token_slots), b, token_slots, base.clone())
    batch = LoRABatch.build(slots, lengths, torch.device(DEVICE), "triton")
    got = batch.apply(x.to(DEVICE), base.clone().to(DEVICE), a_view, b.to(DEVICE), reduce=False)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-5)
