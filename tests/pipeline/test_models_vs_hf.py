"""Logits of fuseserve's model files equal transformers' on the same random weights (fp32, 1e-4).

Each family runs a prompt in one pass, in chunks of 1, 7 and 64 tokens, and packed beside other
sequences' prefill chunks and single-token (decode-shaped) entries.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from tiny_models import CONFIGS, random_prompt, tiny_checkpoint

from fuseserve.config import EngineConfig
from fuseserve.worker.model_runner import ModelRunner

ATOL = 1e-4

MOE = ("mixtral-top2of8", "qwen3moe-top3of8")
WINDOWED = ("mistral-sw16", "gemma2-sw16-softcap")


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, config = tiny_checkpoint(request.param, path)
    runner = ModelRunner(
        path,
        config,
        eos_token_ids=[0],
        progress=False,
        config=EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32"),
    )
    return request.param, hf, runner


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("chunk", [1000, 1, 7, 64])
def test_chunked_prompt_matches_transformers(family, chunk):
    _, hf, runner = family
    tokens = random_prompt(1, 90, hf.config.vocab_size)
    ours = chunked_logits(runner, {1: tokens}, {1: chunk})[1]
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)
    assert runner.num_free_blocks == runner.info.num_blocks


def test_packed_with_other_sequences(family):
    """Sequence 1 in chunks of 7 shares every pass with a 64-token-chunk prefill and three
    single-token entries of different context lengths (the shapes of decode tokens)."""
    _, hf, runner = family
    v = hf.config.vocab_size
    prompts = {
        1: random_prompt(1, 75, v),
        2: random_prompt(2, 150, v),
        3: random_prompt(3, 41, v),
        4: random_prompt(4, 23, v),
        5: random_prompt(5, 60, v),
    }
    sizes = {1: 7, 2: 64, 3: 1, 4: 1, 5: 1}
    ours = chunked_logits(runner, prompts, sizes)
    for sid, tokens in prompts.items():
        torch.testing.assert_close(ours[sid], hf_logits(hf, tokens), atol=ATOL, rtol=0, msg=f"sequence {sid}")
    assert runner.num_free_blocks == runner.info.num_blocks


def _with(hf, tokens: list[int], changes: list[tuple[object, str, object]]) -> torch.Tensor:
    """transformers' logits with ``setattr(obj, name, value)`` applied for one call."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        return hf_logits(hf, tokens)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def test_sliding_window_is_exercised(family):
    """Guard: for Mistral and Gemma 2, the window must change the logits (prompts longer than it)."""
    name, hf, runner = family
    if name not in WINDOWED:
        pytest.skip("no sliding window")
    tokens = random_prompt(7, 48, hf.config.vocab_size)
    full = hf_logits(hf, tokens)
    no_window = _with(hf, tokens, [(hf.config, "sliding_window", 10**6)])
    assert (full[-1] - no_window[-1]).abs().max() > 1e-3
    ours = chunked_logits(runner, {9: tokens}, {9: 5})[9]
    torch.testing.assert_close(ours, full, atol=ATOL, rtol=0)


def test_soft_caps_are_exercised(family):
    """Guard: Gemma 2's attention and final soft-caps each change the logits."""
    name, hf, _ = family
    if not name.startswith("gemma2"):
        pytest.skip("only Gemma 2 soft-caps")
    tokens = random_prompt(8, 40, hf.config.vocab_size)
    full = hf_logits(hf, tokens)
    uncapped_attn = [(layer.self_attn, "attn_logit_softcapping", None) for layer in hf.model.layers]
    uncapped_final = [(hf.config, "final_logit_softcapping", None)]
    for what, changes in (("attention", uncapped_attn), ("final", uncapped_final)):
        assert (full - _with(hf, tokens, changes)).abs().max() > 1e-3, f"{what} soft-cap has no effect"


def test_moe_with_idle_experts(family):
    """A 3-token prompt in one pass reaches at most 3 x top_k experts of 8 per layer, so some
    experts receive no token; logits still equal transformers'."""
    name, hf, runner = family
    if name not in MOE:
        pytest.skip("not a mixture of experts")
    from fuseserve.worker.models.moe import Experts

    used: list[int] = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: used.append(int(inp[1].unique().numel())))
        for m in runner.model.modules()
        if isinstance(m, Experts)
    ]
    try:
        tokens = random_prompt(11, 3, hf.config.vocab_size)
        ours = chunked_logits(runner, {1: tokens}, {1: 3})[1]
    finally:
        for h in hooks:
            h.remove()
    assert used and min(used) < 8, used
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)
