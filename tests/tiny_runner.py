"""Test helper: a real ``ModelRunner`` over a random one-layer LLaMA (vocab 128, 2 heads of 16)."""

from __future__ import annotations


def tiny_llama_runner(path, **engine):
    """Save a random tiny LLaMA to ``path`` and return a CPU ``ModelRunner`` on it.

    ``engine``: ``EngineConfig`` fields (``kv_cache_memory``, ``block_size``, ...); device is CPU, dtype
    float32 unless given.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fuseserve.config import EngineConfig
    from fuseserve.worker.model_runner import ModelRunner

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    engine.setdefault("dtype", "float32")  # fixed block sizes in bytes; ``auto`` is bf16 on some CPUs
    return ModelRunner(path, cfg, [0], EngineConfig(device="cpu", **engine), progress=False)
