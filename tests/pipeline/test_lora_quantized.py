"""LoRA adapters over quantized base weights (GPTQ 4-bit, compressed-tensors FP8; CPU path): logits
equal transformers + PEFT on the dequantized weights the checkpoint encodes, to the tolerance of the
quantized checkpoints' own test (``test_quantized_checkpoints.py``)."""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from lora_checkpoints import peft_model, write_adapters
from quant_checkpoints import write_quantized
from tiny_models import llama_config, random_model, random_prompt

from fuseserve.config import EngineConfig
from fuseserve.worker.lora_layers import LoRALinear
from fuseserve.worker.model_runner import ModelRunner

RTOL = 1e-3
CASES = {"gptq-4bit-g32": dict(fmt="gptq", bits=4, group=32), "ct-fp8-channel": dict(fmt="ct-fp8")}


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_over_quantized_weights(case, tmp_path):
    config = llama_config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip
    hf = random_model(config, seed=3)
    config.quantization_config = write_quantized(hf, tmp_path / "base", **CASES[case])
    adapters = write_adapters(hf, tmp_path)  # on the dequantized weights
    engine = EngineConfig(
        kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32",
        lora_modules=adapters, max_loras=3, max_lora_rank=16,
    )  # fmt: skip
    runner = ModelRunner(tmp_path / "base", config, eos_token_ids=[0], config=engine, progress=False)
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 8 and all(hasattr(m.base, "packed") for m in wrapped)
    v = config.vocab_size
    prompts = {1: random_prompt(1, 50, v), 2: random_prompt(2, 30, v), 3: random_prompt(3, 20, v)}
    prompts[4] = random_prompt(4, 9, v)
    loras = {1: "a4", 2: "a8", 3: "a16"}
    ours = chunked_logits(runner, prompts, {1: 16, 2: 7, 3: 5, 4: 1}, loras)
    reference = peft_model(hf, adapters)
    for sid, tokens in prompts.items():
        with torch.no_grad():
            if sid in loras:
                reference.set_adapter(loras[sid])
                ref = reference(torch.tensor([tokens])).logits[0].float()
            else:
                with reference.disable_adapter():
                    ref = reference(torch.tensor([tokens])).logits[0].float()
        worst = ((ours[sid] - ref).abs().max() / ref.abs().max()).item()
        assert worst <= RTOL, (case, loras.get(sid), worst)
