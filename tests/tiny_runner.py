"""Test helper: a real ``ModelRunner`` over a random one-layer LLaMA (vocab 128, 2 heads of 16)."""

from __future__ import annotations


def tiny_llama_runner(path, **engine):
    """Save a random tiny LLaMA to ``path`` and return a CPU ``ModelRunner`` on it.

    ``engine``: ``EngineConfig`` fields (``kv_cache_memory``, ``block_size``, ...); device is CPU, dtype
    float32 unless given.
    """
    from tiny_models import llama_config, write_checkpoint

    from fuseserve.config import EngineConfig
    from fuseserve.worker.model_runner import ModelRunner

    cfg = llama_config(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256
    )
    write_checkpoint(cfg, path)
    engine.setdefault("dtype", "float32")  # fixed block sizes in bytes; ``auto`` is bf16 on some CPUs
    return ModelRunner(path, cfg, [0], EngineConfig(device="cpu", **engine), progress=False)
