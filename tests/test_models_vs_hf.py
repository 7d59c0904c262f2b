"""Logits of fuseserve's model files equal transformers' on the same random weights (fp32, 1e-4).

Each family runs a prompt in one pass, in chunks of 1, 7 and 64 tokens, and packed beside other
sequences' prefill chunks and single-token (decode-shaped) entries.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, OPTConfig

from fuseserve.config import EngineConfig
from fuseserve.worker.model_runner import ModelRunner

ATOL = 1e-4

CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "llama-tied": lambda: LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ),
    "mistral-sw16": lambda: MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=16,
        architectures=["MistralForCausalLM"],
    ),
    "opt-prenorm": lambda: OPTConfig(
        vocab_size=512,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        word_embed_proj_dim=64,
        do_layer_norm_before=True,
        architectures=["OPTForCausalLM"],
    ),
    "opt-postnorm-proj": lambda: OPTConfig(
        vocab_size=512,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
        architectures=["OPTForCausalLM"],
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # make layer norms non-trivial so a missed weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
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


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("chunk", [1000, 1, 7, 64])
def test_chunked_prompt_matches_transformers(family, chunk):
    _, hf, runner = family
    tokens = prompt(1, 90, hf.config.vocab_size)
    ours = chunked_logits(runner, {1: tokens}, {1: chunk})[1]
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)
    assert runner.num_free_blocks == runner.info.num_blocks


def test_packed_with_other_sequences(family):
    """Sequence 1 in chunks of 7 shares every pass with a 64-token-chunk prefill and three
    single-token entries of different context lengths (the shapes of decode tokens)."""
    _, hf, runner = family
    v = hf.config.vocab_size
    prompts = {
        1: prompt(1, 75, v),
        2: prompt(2, 150, v),
        3: prompt(3, 41, v),
        4: prompt(4, 23, v),
        5: prompt(5, 60, v),
    }
    sizes = {1: 7, 2: 64, 3: 1, 4: 1, 5: 1}
    ours = chunked_logits(runner, prompts, sizes)
    for sid, tokens in prompts.items():
        torch.testing.assert_close(ours[sid], hf_logits(hf, tokens), atol=ATOL, rtol=0, msg=f"sequence {sid}")
    assert runner.num_free_blocks == runner.info.num_blocks


def test_sliding_window_is_exercised(family):
    """Guard: for Mistral, the window must change the logits (prompts longer than the window)."""
    name, hf, runner = family
    if name != "mistral-sw16":
        pytest.skip("only Mistral has a sliding window")
    tokens = prompt(7, 48, hf.config.vocab_size)
    full = hf_logits(hf, tokens)
    hf.config.sliding_window = None
    try:
        no_window = hf_logits(hf, tokens)
    finally:
        hf.config.sliding_window = 16
    assert (full[-1] - no_window[-1]).abs().max() > 1e-3
    ours = chunked_logits(runner, {9: tokens}, {9: 5})[9]
    torch.testing.assert_close(ours, full, atol=ATOL, rtol=0)
