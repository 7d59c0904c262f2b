"""LLaMA / LLaMA-2 / LLaMA-3 over the flattened ragged batch (Touvron et al. 2023).

Pre-norm decoder: ``h = x + Attn(RMSNorm(x))``, ``out = h + MLP(RMSNorm(h))``; grouped-query
attention; rotary positions with the config's rope scaling; SwiGLU MLP. Parameter names are Hugging
Face's; ``qkv_proj`` stacks q, k, v (one GEMM) and ``gate_up_proj`` the gate and up projections,
filled from the separate checkpoint tensors as ``packed_modules_mapping`` declares.

The other LLaMA-shaped families (Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE) differ only in
what ``make_layer`` puts into each ``DecoderLayer``; their files say what.
"""

from __future__ import annotations

import torch
from torch import nn

from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models.layers import Attention, GatedMLP, RMSNorm, Rotary
from fuseserve.worker.parallel import ParallelLMHead, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    """``h = x + attn(norm(x))``; ``out = h + mlp(norm(h))``.

    On CPU ``kernels/cpu_stack.cpp`` replays this forward's operator sequence (with ``Attention``'s,
    ``GatedMLP``'s and ``RMSNorm``'s CPU paths) for all layers in one call (``layer_stack.py``): a change
    here must be made there too; ``tests/unit/test_layer_stack.py`` fails on any difference."""

    def __init__(self, args: ModelArgs, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions)
        normed, h = self.post_attention_layernorm.add_forward(attn, x)  # h = x + attn, then its norm
        return h + self.mlp(normed)


class DecoderModel(nn.Module):
    """Token embedding (times ``embed_scale``), the layers, the final norm."""

    def __init__(self, args: ModelArgs, layers: list[nn.Module], norm: nn.Module, embed_scale: float = 1.0):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:  # Gemma: the scale is rounded to the activation dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` over a ragged batch, ``compute_logits`` only where sampled.

    Class attributes read by the loader (``fuseserve.worker.loader``):
    packed_modules_mapping: checkpoint module name → (our fused module, its part).
    checkpoint_renames: ``(regex, replacement)`` applied to checkpoint names first.
    """

    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    supports_tensor_parallel = True
    qkv_bias = False  # Qwen2: biases on q, k, v
    qk_norm = False  # Qwen3: RMSNorm over each head of q and k
    scale_embeddings = False  # Gemma: embeddings times sqrt(hidden_size)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.rotary = Rotary(args.hf, args.max_position_embeddings)
        layers = [self.make_layer(args, i) for i in range(args.num_layers)]
        embed_scale = args.hidden_size**0.5 if self.scale_embeddings else 1.0
        self.model = DecoderModel(args, layers, self.make_norm(args), embed_scale)
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size)

    def make_layer(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``: attention (with the family's q/k options) and ``make_mlp``'s MLP."""
        attn = Attention(args, layer_idx, self.rotary, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        return DecoderLayer(args, attn, self.make_mlp(args, layer_idx))

    def make_norm(self, args: ModelArgs) -> nn.Module:
        """The final norm (and, in families that override it, the per-layer ones)."""
        return RMSNorm(args.hidden_size, args.norm_eps)

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        """The MLP of layer ``layer_idx``: SwiGLU (mixture-of-experts families override this)."""
        return GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=args.mlp_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` → final hidden states ``[T, hidden]``.

        Attention metadata comes from the enclosing ``forward_context``.
        """
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S', hidden]`` → logits ``[S', vocab]``."""
        return self.lm_head(hidden)
