"""Gemma 2 (Gemma Team 2024) over the flattened ragged batch.

Differences from LLaMA, all read from the config:
- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the activation dtype, as ``transformers``);
- RMSNorm weights stored as ``w - 1`` (``x * (1 + w)``), and four norms per layer: before and after
  attention, before and after the MLP (``h = x + post_attn(attn(pre(x)))``, same for the MLP);
- GeGLU MLP (``gelu_pytorch_tanh``);
- attention scale ``query_pre_attn_scalar**-0.5`` and logit soft-capping ``c * tanh(s / c)`` with
  ``attn_logit_softcapping`` (passed to the attention backend), and on the final logits with
  ``final_logit_softcapping``;
- layers alternate sliding-window (``sliding_window``) and global attention (``layer_types``);
- tied input and output embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models.layers import Attention, GatedMLP, RMSNorm, soft_cap
from fuseserve.worker.models.llama import LlamaForCausalLM


class Gemma2DecoderLayer(nn.Module):
    """``h = x + post_attn(attn(input(x)))``; ``out = h + post_ffw(mlp(pre_ffw(h)))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    scale_embeddings = True

    def make_layer(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        attn = Attention(args, layer_idx, self.rotary)
        return Gemma2DecoderLayer(attn, mlp, lambda: self.make_norm(args))

    def make_norm(self, args: ModelArgs) -> nn.Module:
        return RMSNorm(args.hidden_size, args.norm_eps, unit_offset=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S', hidden]`` → soft-capped logits ``[S', vocab]``."""
        return soft_cap(self.lm_head(hidden), self.args.final_logit_softcap)
