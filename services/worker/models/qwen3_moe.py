"""Qwen3-MoE (Qwen team 2025): Qwen3 attention (q/k norms) with a sparse mixture of experts as MLP.

Each token goes to its top ``num_experts_per_tok`` of ``num_experts`` experts (each a SwiGLU of width
``moe_intermediate_size``); the router probabilities are renormalised over the chosen ones only when
``norm_topk_prob``. Layers in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keep a dense
MLP of width ``intermediate_size``.
"""

from __future__ import annotations

from torch import nn

from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models.llama import LlamaForCausalLM
from fuseserve.worker.models.moe import SparseMoE


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return SparseMoE(args) if args.moe_layers[layer_idx] else super().make_mlp(args, layer_idx)
