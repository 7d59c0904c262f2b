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
