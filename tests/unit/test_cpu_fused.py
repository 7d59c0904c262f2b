"""The fused CPU element-wise operators (``fuseserve.kernels.cpu_fused``) against the layers' ATen ops.

The layers (``services/worker/models/layers.py``) call the operators on CPU in fp32 and bf16 and fall
back to ATen's ops otherwise; each test runs one module both ways on the same inputs. Rotary and the
residual add are the same arithmetic in the same order: equal bit for bit. RMSNorm sums its squares in
fp64 where ATen sums fp32 pairwise, and SiLU's exp is a polynomial: fp32 within a few ulps; bf16 equal
on these inputs, and at most one bf16 step apart anywhere (what a differently rounded fp32 can flip).
Shapes include rows that are not a multiple of 16 lanes (tails), strided views of a stacked
projection (as the layers pass q and k), and partial rotary (48 of 64 dims: a half of 24, one 16-lane step and a tail).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from fuseserve.kernels import cpu_fused
from fuseserve.worker.models.layers import GatedMLP, RMSNorm, Rotary

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C++ compiler: operators not built")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def aten(monkeypatch):
    """Calls ``fn`` with the fused operators switched off (the layers' ATen path)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(cpu_fused, "ENABLED", False)
            return fn()

    return run


def close(fused: torch.Tensor, ref: torch.Tensor) -> None:
    if ref.dtype == torch.bfloat16:  # one bf16 step (2^-8 relative) at most
        torch.testing.assert_close(fused, ref, rtol=2**-7, atol=1e-6)
    else:
        torch.testing.assert_close(fused, ref, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 72])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_and_residual_add(aten, dtype, dim, unit_offset):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5, unit_offset=unit_offset)
    norm.weight.data = torch.rand(dim, generator=g) + 0.5
    norm = norm.to(dtype)
    x = (torch.randn(37, dim, generator=g) * 3).to(dtype)
    r = torch.randn(37, dim, generator=g).to(dtype)
    assert cpu_fused.usable(x, norm.weight)
    close(norm(x), aten(lambda: norm(x)))
    normed, h = norm.add_forward(x, r)
    ref_normed, ref_h = aten(lambda: norm.add_forward(x, r))
    assert torch.equal(h, ref_h) and torch.equal(h, x + r)
    close(normed, ref_normed)
    if dtype == torch.bfloat16 and dim == 576 and not unit_offset:  # the common case: no step at all here
        assert torch.equal(normed, ref_normed)


def test_rms_norm_over_head_views(aten):
    """Qwen3's q / k norm: a ``[T, H, D]`` view of the stacked projection (not contiguous)."""
    qkv = torch.randn(5, 3 * 64 * 4).to(torch.bfloat16)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    out = norm(q)
    assert out.shape == q.shape
    close(out, aten(lambda: norm(q)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 40])
def test_silu_mul(aten, dtype, intermediate):
    mlp = GatedMLP(64, intermediate, "silu").to(dtype)
    x = (torch.randn(19, 64) * 4).to(dtype)
    out = mlp(x)
    ref = aten(lambda: mlp(x))
    close(out, ref)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)


def test_silu_mul_extremes():
    """Large magnitudes and zeros: no overflow in exp, silu(-100) ≈ -0, silu(100) = 100."""
    gate = torch.tensor([[-100.0, -20.0, -1.0, 0.0, 1e-30, 1.0, 20.0, 100.0]])
    up = torch.ones_like(gate)
    out = cpu_fused.silu_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out, torch.nn.functional.silu(gate), rtol=1e-6, atol=1e-30)


def test_gelu_mlp_keeps_aten():
    """Only SiLU is fused: a GeGLU MLP (Gemma) runs ATen's ops."""
    assert not GatedMLP(64, 128, "gelu_pytorch_tanh").silu
    assert GatedMLP(64, 128, "silu").silu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rotary_in_place_is_exact(aten, dtype, partial):
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        partial_rotary_factor=partial,
    )
    rot = Rotary(cfg, 512)
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(23, 4 * 64 + 2 * 2 * 64, generator=g) * 2).to(dtype)
    positions = torch.randint(0, 512, (23,), generator=g)

    def views(t):
        return t[:, :256].view(23, 4, 64), t[:, 256:384].view(23, 2, 64)

    ref_q, ref_k = aten(lambda: rot(*views(qkv.clone()), positions))
    before = qkv.clone()
    q, k = rot(*views(qkv), positions)
    assert q.data_ptr() == qkv.data_ptr()  # in place, in the stacked projection
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, 384:], before[:, 384:])  # v untouched
    if partial < 1.0:  # the dims past rotary_dim are left as they were
        assert torch.equal(q[..., 48:], before[:, :256].view(23, 4, 64)[..., 48:])


def test_rotary_position_outside_the_table_is_an_error():
    q, k = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    table = torch.zeros(8, 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_fused.rotary_(q, k, torch.tensor([3, 8]), table, table)


def test_usable_refuses_what_the_operators_do_not_take():
    x = torch.zeros(2, 16)
    assert cpu_fused.usable(x) and cpu_fused.usable(x.bfloat16())
    assert not cpu_fused.usable(x.half())
    assert not cpu_fused.usable(x, x.bfloat16())  # mixed dtypes: ATen's promotion rules apply


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 37, 49152])  # a row of one; a 16-lane tail; SmolLM2's vocabulary
def test_argmax_is_max_indices(dtype, vocab):
    """The greedy sampler's argmax: ``x.max(-1).indices`` exactly, ties to the first index (here on
    purpose across lanes and steps), -inf rows (index 0) and NaN (the first NaN, as torch.max)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(9, vocab, generator=g) * 5).to(dtype)
    if vocab > 20:
        top = x.max() + 1
        x[0, [3, vocab - 1]] = top  # a tie between the first step and the last
        x[1, [17, 20]] = top  # a tie within one 16-lane step, in two lanes
        x[2, :] = float("-inf")
        x[3, [5, 11]] = float("nan")
        x[4, 0] = float("-inf")
    x = torch.cat([x, x[:, :0].new_full((1, vocab), 2.0)])  # a row of equal values: index 0
    torch.testing.assert_close(cpu_fused.argmax(x), x.max(dim=-1).indices, rtol=0, atol=0)


def test_greedy_sampler_takes_the_fused_argmax(monkeypatch):
    """A plain greedy batch's token ids come from the fused argmax, equal to the ATen path's."""
    from fuseserve.sampling_params import SamplingParams
    from fuseserve.worker.sampler import Sampler, SeqSamplingState

    calls = []
    real = cpu_fused.argmax
    monkeypatch.setattr(cpu_fused, "argmax", lambda x: calls.append(x.shape) or real(x))
    sampler = Sampler([2], 100, lambda: None)
    logits = (torch.randn(4, 100) * 3).bfloat16()
    states = [
        SeqSamplingState.create(SamplingParams(temperature=0.0), [], torch.device("cpu")) for _ in range(4)
    ]
    out = sampler(logits.clone(), states, inplace=True)
    assert calls == [(4, 100)]
    monkeypatch.setattr(cpu_fused, "ENABLED", False)
    ref = sampler(logits.clone(), states, inplace=True)
    assert torch.equal(out.token_ids, ref.token_ids)
