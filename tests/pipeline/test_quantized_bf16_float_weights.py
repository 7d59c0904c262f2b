"""A quantized checkpoint's float embedding and LM head kept in bfloat16 (fp32 compute).

GPTQ and llm-compressor leave the embedding and LM head float, stored in the checkpoint's 16-bit
dtype; fuseserve used to widen them to fp32 (and hold a tied pair twice: the embedding and the LM
head's prepacked copy). Where every value is a bfloat16 value the runner keeps them as bfloat16
(``quantization.keep_float_weights_bf16``): the lookup and the C++ widening kernel compute on exactly
the same numbers. Checked: the modules switched (one shared tensor when tied), the resident bytes,
and logits within 1e-3 of ``transformers`` (relative to the largest logit) with the prompts chunked
and packed, so the LM head runs both its few-row kernel and its chunked GEMM path.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits, max_relative_error
from quant_checkpoints import write_quantized
from tiny_models import llama_config, random_model, random_prompt

from fuseserve.config import EngineConfig
from fuseserve.kernels.cpu_quant_linear import BF16_SMALL_ROWS, Bf16Linear
from fuseserve.worker.model_runner import ModelRunner
from fuseserve.worker.quantization import weight_bytes

RTOL = 1e-3


def _runner(path, config):
    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    return ModelRunner(path, config, eos_token_ids=[0], config=engine, progress=False)


def _quantized(tmp_path, tied: bool, bf16_values: bool):
    config = llama_config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    hf = random_model(config, seed=5)
    if bf16_values:  # as a bf16 checkpoint's float tensors
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    config.quantization_config = write_quantized(hf, tmp_path, fmt="gptq", bits=4, group=32)
    return config, hf


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bf16_float_weights_match_transformers(tied, tmp_path):
    config, hf = _quantized(tmp_path, tied, bf16_values=True)
    runner = _runner(tmp_path, config)
    embed, head = runner.model.model.embed_tokens, runner.model.lm_head
    assert isinstance(embed.packed, Bf16Linear) and isinstance(head.packed, Bf16Linear)
    assert embed.weight is None and head.weight is None
    assert (embed.packed is head.packed) == tied
    table = config.vocab_size * config.hidden_size
    decoder = sum(m.packed.nbytes() for m in runner.model.modules() if hasattr(m, "quant_scheme"))
    norms = sum(p.numel() * 4 for p in runner.model.parameters())
    assert weight_bytes(runner.model) == decoder + norms + table * 2 * (1 if tied else 2)

    v = config.vocab_size
    prompts = {1: random_prompt(1, 70, v), 2: random_prompt(2, 40, v), 3: random_prompt(3, 5, v)}
    sizes = {1: 16, 2: 16, 3: 1}
    assert sum(sizes.values()) > BF16_SMALL_ROWS  # the first passes' LM head takes the GEMM path
    ours = chunked_logits(runner, prompts, sizes)
    worst = max_relative_error(hf, prompts, ours)
    print(f"\nbf16 float weights, tied={tied}: max |fuseserve - transformers| / max |logit| = {worst:.2e}")
    assert worst <= RTOL


def test_float_weights_not_bf16_exact_stay_fp32(tmp_path):
    config, _ = _quantized(tmp_path, tied=True, bf16_values=False)
    runner = _runner(tmp_path, config)
    embed = runner.model.model.embed_tokens
    assert not hasattr(embed, "packed") and embed.weight.dtype == torch.float32
