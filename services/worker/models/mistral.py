"""Mistral (Jiang et al. 2023): the LLaMA architecture with sliding-window attention.

A query at position p attends to keys at positions ``> p - sliding_window`` (``transformers``'
convention). The window is honoured by the attention backend through the forward context.
"""

from __future__ import annotations

from fuseserve.worker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.sliding_window = getattr(config, "sliding_window", None)
