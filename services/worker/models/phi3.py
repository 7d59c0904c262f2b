"""Phi-3 (Abdin et al. 2024): the LLaMA architecture with fused checkpoint tensors and LongRoPE.

Checkpoints already store ``qkv_proj`` (q, k, v rows) and ``gate_up_proj`` (gate, up rows), which are
this model's own parameters, so nothing is repacked. ``su`` / ``longrope`` scaling (Ding et al. 2024)
and ``partial_rotary_factor`` are handled by the shared ``Rotary``: short factors below
``original_max_position_embeddings``, long factors from there on. A config ``sliding_window`` applies to
every layer.
"""

from __future__ import annotations

from fuseserve.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
