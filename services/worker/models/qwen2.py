"""Qwen2 / Qwen2.5 (Yang et al. 2024): the LLaMA architecture with biases on the q, k, v projections.

Layers listed as ``sliding_attention`` in the config's ``layer_types`` (only with
``use_sliding_window``) attend within ``sliding_window``; ``ModelArgs`` resolves that per layer.
"""

from __future__ import annotations

from fuseserve.worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
