"""Logits with LoRA adapters equal transformers + PEFT on the same random weights (fp32, 1e-4).

LLaMA, Qwen2 (q/k/v biases), Mixtral (attention adapters over a mixture of experts) and Phi-3
(adapters on the checkpoint's fused ``qkv_proj`` / ``gate_up_proj``) shapes, three
PEFT adapters of ranks 4, 8 and 16 with different target modules (one rsLoRA), random A and B. The
adapters' sequences and a base sequence share every pass, in chunks of different sizes, and the
model's adapter slots are fewer than the adapters asked for over the test (slots are reused).
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from lora_checkpoints import peft_model, write_adapters
from tiny_models import random_prompt, tiny_checkpoint

from fuseserve.config import EngineConfig
from fuseserve.worker.lora_layers import LoRALinear
from fuseserve.worker.model_runner import ModelRunner

ATOL = 1e-4
FAMILIES = ["llama-gqa", "qwen2-bias", "mixtral-top2of8", "phi3-longrope-partial"]  # Phi-3: fused q/k/v


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf, config = tiny_checkpoint(request.param, root / "base")
    adapters = write_adapters(hf, root, request.param)
    runner = ModelRunner(
        root / "base",
        config,
        eos_token_ids=[0],
        progress=False,
        config=EngineConfig(
            kv_cache_memory="16MiB",
            block_size=16,
            device="cpu",
            dtype="float32",
            lora_modules=adapters,
            max_loras=3,
            max_lora_rank=16,
        ),
    )
    return hf, peft_model(hf, adapters), runner


def _peft_logits(model, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokens])
        if adapter is None:
            with model.disable_adapter():
                return model(ids).logits[0].float()
        model.set_adapter(adapter)
        return model(ids).logits[0].float()


def test_adapters_and_base_in_the_same_passes(family):
    hf, peft, runner = family
    v = hf.config.vocab_size
    prompts = {1: random_prompt(1, 70, v), 2: random_prompt(2, 33, v), 3: random_prompt(3, 50, v)}
    prompts[4] = random_prompt(4, 41, v)
    loras = {1: "a4", 2: "a8", 3: "a16"}  # 4: the base model
    ours = chunked_logits(runner, prompts, {1: 7, 2: 16, 3: 5, 4: 9}, loras)
    for sid, tokens in prompts.items():
        want = _peft_logits(peft, loras.get(sid), tokens)
        torch.testing.assert_close(ours[sid], want, atol=ATOL, rtol=0, msg=f"adapter {loras.get(sid)}")
    assert runner.num_free_blocks == runner.info.num_blocks


def test_each_adapter_changes_the_logits(family):
    """Guard: every adapter moves the logits well past the tolerance (a no-op adapter proves nothing)."""
    hf, peft, _ = family
    tokens = random_prompt(5, 20, hf.config.vocab_size)
    base = _peft_logits(peft, None, tokens)
    for name in ("a4", "a8", "a16"):
        assert (base - _peft_logits(peft, name, tokens)).abs().max() > 100 * ATOL, name


def test_one_adapter_per_pass_and_decode_shapes(family):
    """Adapters one after the other with single-token entries beside them (decode shapes)."""
    hf, peft, runner = family
    v = hf.config.vocab_size
    for name in ("a16", "a4", "a8"):
        prompts = {7: random_prompt(7, 24, v), 8: random_prompt(8, 6, v)}
        ours = chunked_logits(runner, prompts, {7: 24, 8: 1}, {7: name, 8: name})
        for sid, tokens in prompts.items():
            torch.testing.assert_close(ours[sid], _peft_logits(peft, name, tokens), atol=ATOL, rtol=0)
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALinear)]
    per_layer = 2 if hf.config.model_type == "mixtral" else 4  # qkv, o (+ gate_up, down when dense)
    assert len(wrapped) == per_layer * hf.config.num_hidden_layers
