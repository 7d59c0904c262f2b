"""The flash-attn adapter (``kernels/flash_attn.py``) and the backend choice in ``get_backend``.

The adapter's numeric tests need flash-attn and an SM80+ GPU and skip elsewhere, saying which is
missing; the choice rules run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from fuseserve.errors import AttentionBackendUnavailableError, InvalidParameterError
from fuseserve.kernels import flash_attn
from fuseserve.worker.attention import TorchAttentionBackend, get_backend

CUDA = torch.device("cuda") if torch.cuda.is_available() else None


def _flash_skip_reason() -> str | None:
    if CUDA is None:
        return "flash-attn adapter needs a CUDA GPU (none visible)"
    return flash_attn.unsupported_reason(CUDA, flash_attn.PAGE_MULTIPLE, torch.bfloat16)


needs_flash = pytest.mark.skipif(_flash_skip_reason() is not None, reason=str(_flash_skip_reason()))


@needs_flash
@pytest.mark.parametrize("window,cap", [(None, None), (100, None), (None, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_kernel_matches_reference(window, cap, dtype):
    from test_triton_kernels import TOL, make_pass, run_reference

    page = flash_attn.PAGE_MULTIPLE
    seqs = [(0, 300), (280, 40), (700, 1), (255, 1)]  # chunks and decodes crossing 256-token pages
    p = make_pass(seqs, page, 2, 3, 128, dtype)
    plan = flash_attn.plan_attention(
        p["query_lens"], p["context_lens"], p["cu_seqlens_q"], p["block_tables"], p["slot_mapping"]
    )
    k_cache, v_cache = p["k_cache"].clone(), p["v_cache"].clone()
    k_cache.view(-1, 2, 128).index_copy_(0, plan.slot_mapping, p["k"])
    v_cache.view(-1, 2, 128).index_copy_(0, plan.slot_mapping, p["v"])
    got = flash_attn.paged_attention(p["q"], k_cache, v_cache, plan, 128**-0.5, window, cap)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), run_reference(p, window, cap, 128**-0.5), atol=atol, rtol=rtol)


def test_flash_attn_kernel_reasons_are_plain():
    assert (
        flash_attn.unsupported_reason(torch.device("cpu"), 16, torch.float32)
        == "flash-attn needs a CUDA device"
    )
    if CUDA is not None and torch.cuda.get_device_capability()[0] >= 8 and flash_attn.import_error() is None:
        assert "multiple of 256" in flash_attn.unsupported_reason(CUDA, 16, torch.bfloat16)
        assert "float32" in flash_attn.unsupported_reason(CUDA, 256, torch.float32)


def test_kernel_backend_choice_on_cpu():
    cpu = torch.device("cpu")
    assert get_backend("auto", cpu).name in (
        "cpu",
        "torch",
    )  # the C++ operator, or the reference without a compiler
    assert isinstance(get_backend("torch", cpu), TorchAttentionBackend)
    with pytest.raises(AttentionBackendUnavailableError, match="CUDA"):
        get_backend("flash-attn", cpu, block_size=16, dtype=torch.float32)
    with pytest.raises(InvalidParameterError, match="attention_backend"):
        get_backend("xformers", cpu)


@pytest.mark.skipif(CUDA is None, reason="backend choice on a GPU needs a CUDA device")
def test_kernel_backend_choice_on_gpu():
    pytest.importorskip("triton", reason="triton is not installed")
    backend = get_backend("auto", CUDA, block_size=16, dtype=torch.bfloat16)
    assert backend.name == "triton"  # flash-attn's paged KV cannot take 16-token blocks
    if _flash_skip_reason() is None:
        assert get_backend("auto", CUDA, block_size=256, dtype=torch.bfloat16).name == "flash-attn"


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["worker", "--redis-url", "redis://x"]])
def test_kernel_backend_flag_on_engine_commands(command):
    """``--attention-backend`` is an engine option of generate, serve and worker, checked by argparse;
    ``serve`` hands it to its workers."""
    from fuseserve.cli import build_parser
    from fuseserve.config import EngineConfig

    args = build_parser().parse_args([*command, "--attention-backend", "triton"])
    assert args.attention_backend == "triton"
    assert build_parser().parse_args(command).attention_backend == EngineConfig().attention_backend == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--attention-backend", "xformers"])
    with pytest.raises(InvalidParameterError, match="attention_backend"):
        EngineConfig(attention_backend="xformers").validate()


def documented_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap, block_table
):
    """flash-attn's ``flash_attn_varlen_func`` over a paged cache as its docstring specifies it: causal
    masks align to the bottom right (query i of sq over sk keys sits at key i + sk - sq); a window
    (left, right) keeps keys in ``[i + sk - sq - left, i + sk - sq + right]``; softcap c > 0 caps scores."""
    page, out = k.shape[1], torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        qs, sq, sk = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        pos = torch.arange(sk, device=q.device)
        slots = block_table[b, pos // page].long() * page + pos % page
        kb = k.view(-1, *k.shape[2:])[slots].repeat_interleave(q.shape[1] // k.shape[2], 1)
        vb = v.view(-1, *v.shape[2:])[slots].repeat_interleave(q.shape[1] // k.shape[2], 1)
        s = torch.einsum("qhd,khd->hqk", q[qs : qs + sq].float(), kb.float()) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        at = torch.arange(sq, device=q.device)[:, None] + sk - sq
        keep = pos[None, :] <= at if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        left, right = window_size
        if left >= 0:
            keep &= pos[None, :] >= at - left
        if right >= 0:
            keep &= pos[None, :] <= at + right
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        out[qs : qs + sq] = torch.einsum("hqk,khd->qhd", p, vb.float()).to(q.dtype)
    return out


@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 20.0), (3, 5.0)])
def test_flash_attn_kernel_adapter_arguments_follow_flash_attn_semantics(monkeypatch, window, cap):
    """Runs everywhere: flash-attn replaced by its documented semantics, written out above, so the
    adapter's plan (cu_seqlens_k, max lengths, block table) and its mapping of the window and the
    soft-cap are checked against the reference without a GPU."""
    import sys
    import types

    from test_triton_kernels import MIXED, make_pass, run_reference

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = lambda q, k, v, cu_q, cu_k, mq, mk, **kw: documented_varlen(
        q, k, v, cu_q, cu_k, mq, mk, **kw
    )
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    p = make_pass(MIXED, 16, 2, 3, 64, torch.float32, seed=6)
    plan = flash_attn.plan_attention(
        p["query_lens"], p["context_lens"], p["cu_seqlens_q"], p["block_tables"], p["slot_mapping"]
    )
    assert plan.max_seqlen_q == max(p["query_lens"]) and plan.max_seqlen_k == max(p["context_lens"])
    k_cache, v_cache = p["k_cache"].clone(), p["v_cache"].clone()
    k_cache.view(-1, 2, 64).index_copy_(0, plan.slot_mapping, p["k"])
    v_cache.view(-1, 2, 64).index_copy_(0, plan.slot_mapping, p["v"])
    got = flash_attn.paged_attention(p["q"], k_cache, v_cache, plan, 0.125, window, cap)
    torch.testing.assert_close(got, run_reference(p, window, cap, 0.125), atol=1e-5, rtol=1e-5)
