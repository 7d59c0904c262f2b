"""Prepacked oneDNN linear layers (services/worker/prepacked_linear.py): same output as F.linear, the
plain weight dropped unless tied, bf16 packed only where oneDNN multiplies it natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fuseserve.worker import prepacked_linear

pytestmark = pytest.mark.skipif(
    not prepacked_linear.available(), reason="this torch has no oneDNN packed linear"
)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as an LM head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_linear(dtype):
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    x = torch.randn(5, 32).to(dtype)
    plain = {
        n: (m.weight.detach().clone(), m.bias) for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    packed = prepacked_linear.prepack(model)
    native_bf16 = torch.bfloat16 in prepacked_linear._packable_dtypes()
    if dtype == torch.bfloat16 and not native_bf16:
        assert packed == 0 and model.up.weight is not None
        return
    assert packed == 3
    assert model.up.weight is None and model.down.weight is None  # replaced by the packed copy
    assert model.head.weight is model.embed.weight  # tied: the embedding keeps it
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("up", "down", "head"):
        w, b = plain[name]
        inp = x if name != "down" else torch.randn(5, 64).to(dtype)
        torch.testing.assert_close(getattr(model, name)(inp), F.linear(inp, w, b), atol=tol, rtol=tol)


def _stack_ops():
    ops = prepacked_linear._row_split_ops()
    if ops is None:
        pytest.skip("the C++ stack operator does not build here")
    return ops


def test_bf16_row_counts_are_padded_to_few_buckets():
    """bf16 passes run their linears at bucketed row counts (oneDNN builds a matmul per count)."""
    ops = _stack_ops()
    pad = lambda t, dt=torch.bfloat16: ops.padded_rows(t, dt)  # noqa: E731
    assert [pad(t) for t in (1, 13, 16, 17, 200, 256, 257, 500, 513, 1000, 1024, 1025)] == [
        1, 13, 16, 32, 208, 256, 288, 512, 576, 1024, 1024, 1152
    ]  # fmt: skip
    assert pad(200, torch.float32) == 200 and pad(1000, torch.float32) == 1000
    counts = prepacked_linear.padded_row_counts(1024)
    assert counts[:17] == list(range(1, 17)) + [32] and counts[-1] == 1024 and len(counts) == 47
    assert all(pad(t) in counts for t in range(1, 1025))


def test_padded_bf16_linear_keeps_each_rows_result():
    """A 200-row bf16 product runs at 208 rows: the 200 rows returned are each row's own product."""
    ops = _stack_ops()
    if torch.bfloat16 not in prepacked_linear._packable_dtypes():
        pytest.skip("bf16 linears are not packed on this CPU")
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, prepacked_linear.BATCH_HINT)
    x = torch.randn(200, 64).bfloat16()
    got = ops.linear(x, packed, b)
    assert got.shape == (200, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-2, rtol=2e-2)
