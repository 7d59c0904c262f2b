"""Mixtral (Jiang et al. 2024): the Mistral architecture with a sparse mixture of experts as MLP.

Each token goes to the top 2 of 8 experts (``num_experts_per_tok`` of ``num_local_experts``), their
SwiGLU outputs weighted by the renormalised router probabilities (``moe.SparseMoE``). Checkpoints
name the MLP ``block_sparse_moe`` and the expert parts ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from torch import nn

from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models.llama import LlamaForCausalLM
from fuseserve.worker.models.moe import SparseMoE


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return SparseMoE(args)
