"""Which models and passes run their decoder layers as one C++ call (``kernels/cpu_stack.py``).

A model takes the stack when every layer is ``llama.DecoderLayer`` with ``layers.Attention`` (no q/k
norm, no soft-cap) and a SiLU ``layers.GatedMLP``, its norms plain ``RMSNorm``, its linears packed
(``prepacked_linear``), on one rank, on the CPU in fp32 / bf16, with the C++ attention backend over a
cache in the model's dtype, no LoRA adapters and no compiled forward: LLaMA, Mistral, Qwen2, Phi-3
(their files add nothing else). Every pass takes it but one with LoRA adapters, which runs the
Python layers.
``FUSESERVE_LAYER_STACK=0`` turns it off. The output is the Python layers' bit for bit (same operators,
same order); ``tests/unit/test_layer_stack.py`` checks it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fuseserve.kernels import cpu_fused, cpu_stack
from fuseserve.worker import parallel
from fuseserve.worker.attention import CpuAttentionBackend
from fuseserve.worker.models.layers import Attention, GatedMLP, RMSNorm
from fuseserve.worker.models.llama import DecoderLayer, DecoderModel

log = logging.getLogger(__name__)


def _linear(linear: nn.Module, empty: torch.Tensor) -> list[torch.Tensor]:
    """A packed linear's three stack weights: the packed weight, its bias and its small-pass copy (an
    empty tensor for a missing one)."""
    bias = linear.bias.detach() if linear.bias is not None else empty
    small = getattr(linear, "small_weight", None)
    return [linear.packed_weight, bias, small if small is not None else empty]


def unsupported(model: nn.Module, backend, kv_dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot run its layers as the stack here; None when it can."""
    decoder = getattr(model, "model", None)
    if not cpu_stack.ENABLED:
        return "FUSESERVE_LAYER_STACK=0"
    if type(decoder) is not DecoderModel or decoder.embed_scale != 1.0 or type(decoder.norm) is not RMSNorm:
        return f"{type(model).__name__} is not LLaMA-shaped"
    if parallel.world()[1] != 1 or not isinstance(backend, CpuAttentionBackend):
        return "tensor parallelism or a non-CPU attention backend"
    dtype = decoder.norm.weight.dtype
    if dtype not in cpu_fused.DTYPES or kv_dtype != dtype or decoder.norm.weight.device.type != "cpu":
        return f"{dtype} weights with a {kv_dtype} KV cache"
    first = decoder.layers[0]
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not GatedMLP:
            return f"layer type {type(layer).__name__}"
        if attn.q_norm is not None or attn.soft_cap is not None or not mlp.silu:
            return "q/k norm, soft-capped attention or a non-SiLU MLP"
        if attn.scale != first.self_attn.scale or attn.rotary is not first.self_attn.rotary:
            return "layers with different attention scales or rotary tables"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.unit_offset or n.eps != first.input_layernorm.eps for n in norms):
            return "norms other than plain RMSNorm with one epsilon"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(getattr(m, "packed_weight", None) is None for m in linears):
            return "linear layers not packed for oneDNN"
    if not cpu_stack.available():
        return "the operator does not build here"
    return None


class LayerStack:
    """``model.model``'s layers as one ``cpu_stack.decoder_layers`` call; build with ``LayerStack.build``."""

    def __init__(self, model: nn.Module, kv_cache):
        decoder = model.model
        self.decoder = decoder
        self.kv_cache = kv_cache
        first = decoder.layers[0].self_attn
        self.rotary = first.rotary
        self.shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        self.eps = decoder.layers[0].input_layernorm.eps
        self.scale = first.scale
        self.windows = [layer.self_attn.sliding_window or 0 for layer in decoder.layers]
        empty = torch.empty(0, dtype=decoder.norm.weight.dtype)
        self.weights: list[torch.Tensor] = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.weights.append(layer.input_layernorm.weight.detach())
            self.weights += _linear(attn.qkv_proj, empty) + _linear(attn.o_proj, empty)
            self.weights.append(layer.post_attention_layernorm.weight.detach())
            self.weights += _linear(mlp.gate_up_proj, empty) + _linear(mlp.down_proj, empty)

    @classmethod
    def build(cls, model: nn.Module, backend, kv_cache, kv_dtype: torch.dtype, lora) -> LayerStack | None:
        """The stack of ``model`` over ``kv_cache``, or None (the reason logged) where it does not apply."""
        why = "LoRA adapters" if lora is not None else unsupported(model, backend, kv_dtype)
        if why is not None:
            log.info("decoder layers run in Python: %s", why)
            return None
        log.info("decoder layers run as one C++ call per pass (FUSESERVE_LAYER_STACK=0: Python)")
        return cls(model, kv_cache)

    def accepts(self, batch) -> bool:
        """Whether this pass can take the stack: no LoRA tokens, the operators switched on
        (``cpu_stack.ENABLED``, ``cpu_fused.ENABLED``: benchmarks toggle them)."""
        return cpu_stack.ENABLED and cpu_fused.ENABLED and batch.lora is None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (int64) → final hidden states ``[T, hidden]``, as ``model(...)``."""
        heads, kv_heads, head_dim = self.shape
        x = cpu_stack.decoder_layers(
            self.decoder.embed_tokens(input_ids),
            positions.contiguous(),
            self.rotary.cos,
            self.rotary.sin,
            self.weights,
            self.kv_cache.k,
            self.kv_cache.v,
            metadata,
            self.windows,
            heads,
            kv_heads,
            head_dim,
            self.eps,
            self.scale,
        )
        return self.decoder.norm(x)
