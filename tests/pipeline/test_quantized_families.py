"""Every dense family of ``tests/tiny_models.CONFIGS`` served from a quantized checkpoint.

The quantized linear layer replaces each family's own layers (``services/worker/quantization.py``),
so any family loads any supported format; this checks that it computes right on each: the family's
tiny random model written as GPTQ 4-bit per output channel (any hidden size divides into one group),
fuseserve's logits (fp32, chunks of 16 packed beside a second prompt) within 1e-3 of ``transformers``
on the dequantized weights, relative to the largest logit. The mixture-of-experts families are
checked in ``test_quantized_checkpoints.py`` (with their router near-tie rule).
"""

from __future__ import annotations

import pytest
from engine_driver import chunked_logits, max_relative_error
from quant_checkpoints import write_quantized
from tiny_models import CONFIGS, random_model, random_prompt

from fuseserve.config import EngineConfig
from fuseserve.worker.model_runner import ModelRunner

RTOL = 1e-3
DENSE = [name for name in CONFIGS if not name.startswith(("mixtral", "qwen3moe"))]


@pytest.mark.parametrize("family", DENSE)
def test_quantized_family_matches_transformers(family, tmp_path):
    config = CONFIGS[family]()
    hf = random_model(config, seed=7, perturb_norms=True)
    config.quantization_config = write_quantized(hf, tmp_path, fmt="gptq", bits=4, group=-1)
    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    runner = ModelRunner(tmp_path, config, eos_token_ids=[0], config=engine, progress=False)
    assert sum(hasattr(m, "quant_scheme") for m in runner.model.modules()) >= 2 * 3  # qkv, o, MLP per layer
    v = config.vocab_size
    prompts = {1: random_prompt(1, 40, v), 2: random_prompt(2, 9, v)}
    ours = chunked_logits(runner, prompts, {1: 16, 2: 16})
    worst = max_relative_error(hf, prompts, ours)
    print(f"\n{family} GPTQ 4-bit: max |fuseserve - transformers| / max |logit| = {worst:.2e}")
    assert worst <= RTOL
