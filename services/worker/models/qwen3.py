"""Qwen3 (Qwen team 2025): the LLaMA architecture with RMSNorm over each head of q and k.

The q/k norms (``q_norm``, ``k_norm``, over ``head_dim``) run before rotary; no q/k/v biases.
"""

from __future__ import annotations

from fuseserve.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
