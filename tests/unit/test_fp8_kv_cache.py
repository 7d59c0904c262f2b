"""FP8 KV cache (``kernels/kv_quant.py``): e4m3 storage with per-tensor scales, written quantized and
read inside attention by the reference, the C++ CPU operator and the Triton kernels.

The oracle for an fp8 pass is the reference run on a float cache holding the dequantized values of the
same fp8 cache (``x_fp8 * scale``): reading fp8 inside attention must equal attention over what the
cache stands for. Scales other than 1.0 (K 0.5, V 2.0) check that each kernel applies them. The
Triton case is small (``TRITON_INTERPRET=1`` on CPU is slow).
"""

from __future__ import annotations

import pytest
import torch

from fuseserve.config import EngineConfig
from fuseserve.errors import AttentionBackendUnavailableError, InvalidParameterError
from fuseserve.kernels import cpu_attention, kv_quant, reference
from fuseserve.worker.kv_cache import KVCache

try:
    from fuseserve.kernels.triton_fp8 import fp8_decode, fp8_encode
    from fuseserve.kernels.triton_runtime import tl, triton
except ImportError:
    triton = None

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as test_triton_kernels
K_SCALE, V_SCALE = 0.5, 2.0
MIXED = [(0, 21), (29, 9), (47, 1), (15, 1), (70, 1)]  # (cached, new) tokens per sequence


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -3.0, 0.3, 500.0, -1e6])
    q = kv_quant.quantize(x, 1.0)
    assert q.dtype == torch.float8_e4m3fn
    back = kv_quant.dequantize(q, 1.0, torch.float32)
    assert back[:3].tolist() == [0.0, 1.0, -3.0]  # exactly representable
    assert back[4] == 448.0 and back[5] == -448.0  # saturated, not NaN
    assert abs(back[3] - 0.3) <= 0.3 * 2**-4  # 3 mantissa bits: half an ulp of 1/8 relative
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(x, 4.0), 4.0, torch.float32)[:2], x[:2])
    assert kv_quant.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_cache_dtype("int8", torch.float32)
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp16").validate()


def test_an_fp8_pool_holds_twice_the_blocks_of_bf16():
    shape = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
    memory = 64 << 20
    bf16 = KVCache.num_blocks_for(memory, dtype=torch.bfloat16, **shape)
    fp8 = KVCache.num_blocks_for(memory, dtype=kv_quant.FP8, **shape)
    fp32 = KVCache.num_blocks_for(memory, dtype=torch.float32, **shape)
    assert fp8 == 2 * bf16 == 4 * fp32
    cache = KVCache(2, 4, 16, 3, 64, kv_quant.FP8, torch.device("cpu"))
    assert cache.k[0].dtype == kv_quant.FP8 and cache.k_scale == [1.0, 1.0] == cache.v_scale


def _fp8_pass(make_pass, *args):
    """A pass whose cached K/V are fp8 (scaled), and the same pass over their dequantized float values."""
    p = make_pass(*args)
    kc, vc = kv_quant.quantize(p["k_cache"], K_SCALE), kv_quant.quantize(p["v_cache"], V_SCALE)
    dtype = p["q"].dtype
    fp8 = dict(p, k_cache=kc, v_cache=vc)
    dq = dict(
        p,
        k_cache=kv_quant.dequantize(kc, K_SCALE, torch.float32).to(dtype),
        v_cache=kv_quant.dequantize(vc, V_SCALE, torch.float32).to(dtype),
        # the new tokens as the fp8 cache will hold them
        k=kv_quant.dequantize(kv_quant.quantize(p["k"], K_SCALE), K_SCALE, torch.float32).to(dtype),
        v=kv_quant.dequantize(kv_quant.quantize(p["v"], V_SCALE), V_SCALE, torch.float32).to(dtype),
    )
    return fp8, dq


def _reference(p, window=None, cap=None, scale=0.125):
    k_cache, v_cache = p["k_cache"].clone(), p["v_cache"].clone()
    plan = reference.plan_attention(
        p["query_lens"], p["context_lens"], p["block_tables"], p["slot_mapping"], p["page"]
    )
    kw = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    reference.write_kv(k_cache, v_cache, p["k"], p["v"], plan.slot_mapping, **kw)
    out = reference.paged_attention(p["q"], k_cache, v_cache, plan, scale, window, cap, **kw)
    return out, k_cache, v_cache


@pytest.fixture(scope="module")
def make_pass():
    from test_triton_kernels import make_pass

    return make_pass


@pytest.mark.parametrize("window,cap", [(None, None), (20, 30.0)], ids=str)
def test_reference_reads_fp8_as_its_dequantized_values(make_pass, window, cap):
    fp8, dq = _fp8_pass(make_pass, MIXED, 16, 2, 3, 64, torch.float32)
    got, kc, _ = _reference(fp8, window, cap)
    want, kd, _ = _reference(dq, window, cap)
    assert kc.dtype == kv_quant.FP8
    assert torch.equal(kv_quant.dequantize(kc, K_SCALE, torch.float32), kd)  # the write quantizes
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler: operator not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_operator_reads_fp8(make_pass, dtype):
    fp8, _ = _fp8_pass(make_pass, MIXED, 16, 2, 3, 64, dtype)
    fp8 = {k: v.cpu() if torch.is_tensor(v) else v for k, v in fp8.items()}  # a CPU operator
    want, kr, vr = _reference(fp8, 20, None)
    plan = cpu_attention.CpuAttentionMetadata(
        fp8["slot_mapping"], fp8["block_tables"], fp8["cu_seqlens_q"], fp8["seq_lens"]
    )
    kc, vc = fp8["k_cache"].clone(), fp8["v_cache"].clone()
    got = cpu_attention.write_and_attend(
        fp8["q"], fp8["k"], fp8["v"], kc, vc, plan, 0.125, 20, None, k_scale=K_SCALE, v_scale=V_SCALE
    )
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want.flatten(1), atol=tol, rtol=tol)


def test_triton_reads_and_writes_fp8(make_pass):
    tri = pytest.importorskip("fuseserve.kernels.triton_attention")
    seqs = [(0, 9), (21, 1), (33, 1)]
    fp8, _ = _fp8_pass(make_pass, seqs, 16, 1, 2, 32, torch.float32)
    want, kr, vr = _reference(fp8)
    keys = ("query_lens", "context_lens", "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "page")
    plan = tri.plan_attention(*(fp8[k] for k in keys))
    kc, vc = fp8["k_cache"].clone(), fp8["v_cache"].clone()
    tri.write_kv(kc, vc, fp8["k"], fp8["v"], plan.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(kc.view(torch.uint8).cpu(), kr.view(torch.uint8).cpu())
    assert torch.equal(vc.view(torch.uint8).cpu(), vr.view(torch.uint8).cpu())
    got = tri.paged_attention(fp8["q"], kc, vc, plan, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=2e-5, rtol=2e-5)


def test_flash_attn_is_refused_for_an_fp8_cache():
    from fuseserve.worker.attention import get_backend

    with pytest.raises(AttentionBackendUnavailableError, match="fp8"):
        get_backend("flash-attn", torch.device("cpu"), kv_cache_dtype=kv_quant.FP8)
    assert get_backend("auto", torch.device("cpu"), kv_cache_dtype=kv_quant.FP8).name in ("cpu", "torch")


def test_triton_fp8_codec_equals_torch():
    """``triton_fp8``: every finite byte decodes as torch does; values across e4m3's range (subnormals,
    ties, carries into the next exponent, ±448) encode as torch does."""
    if triton is None:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(7)
    grid = kv_quant.dequantize(torch.arange(256, dtype=torch.uint8).view(kv_quant.FP8), 1.0, torch.float32)
    finite = grid[~grid.isnan()]
    mids = (finite.sort().values[1:] + finite.sort().values[:-1]) / 2  # exact ties
    x = torch.cat([finite, mids, torch.randn(700, generator=g) * 10, torch.rand(300, generator=g) * 0.02])
    x = x.clamp(-448, 448).contiguous()
    n = x.numel()
    b = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    b[b.view(kv_quant.FP8).float().isnan()] = 0
    y, enc = torch.empty(n, device=DEVICE), torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _codec[(1,)](x.to(DEVICE), b.to(DEVICE), y, enc, n, BLOCK=triton.next_power_of_2(n))
    assert torch.equal(y.cpu(), b.view(kv_quant.FP8).float())
    assert torch.equal(enc.cpu(), kv_quant.quantize(x, 1.0).view(torch.uint8))


if triton is not None:

    @triton.jit
    def _codec(x_ptr, b_ptr, y_ptr, enc_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < n
        tl.store(enc_ptr + i, fp8_encode(tl.load(x_ptr + i, mask=ok, other=0.0)), mask=ok)
        tl.store(y_ptr + i, fp8_decode(tl.load(b_ptr + i, mask=ok, other=0)), mask=ok)
