"""Mistral (Jiang et al. 2023): the LLaMA architecture with sliding-window attention.

A query at position p attends to keys at positions ``> p - sliding_window`` (``transformers``'
convention). The window is per layer in ``ModelArgs.sliding_windows`` (all layers alike here) and
each layer passes it to the attention backend with its call.
"""

from __future__ import annotations

from fuseserve.worker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
