"""Peak resident memory of the generic loader stays within 1.3x of the weights' size.

Measured in a subprocess by ``benchmarks.load_memory`` (peak RSS during the load, imports excluded):
SmolLM2-135M (fp32 checkpoint, loaded as fp32: read in place) and a small Mixtral (bf16 checkpoint,
loaded as fp32: converted through the bounded staging buffer).
"""

from __future__ import annotations

import torch
from tiny_models import random_model
from transformers import MixtralConfig

from benchmarks.load_memory import measure

LIMIT = 1.3


def test_smollm2_peak_memory(smollm2_source):
    r = measure(str(smollm2_source.path), "float32")
    assert r["weights_bytes"] > 500e6
    assert r["ratio"] <= LIMIT, r


def test_small_mixtral_peak_memory(tmp_path):
    config = MixtralConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        architectures=["MixtralForCausalLM"],
    )
    random_model(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    r = measure(str(tmp_path), "float32")
    assert r["weights_bytes"] > 50e6
    assert r["ratio"] <= LIMIT, r
