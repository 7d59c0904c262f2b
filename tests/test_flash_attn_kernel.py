"""The flash-attn adapter (``kernels/flash_attn.py``) and the backend choice in ``get_backend``.

The adapter's numeric tests need flash-attn and an SM80+ GPU and skip elsewhere, saying which is
missing; the choice rules run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from fuseserve.errors import InvalidParameterError
from fuseserve.kernels import flash_attn
from fuseserve.worker.attention import AttentionBackendUnavailableError, TorchAttentionBackend, get_backend

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
    assert isinstance(get_backend("auto", cpu), TorchAttentionBackend)
    assert get_backend("torch", cpu).name == "torch"
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
