"""OPT (Zhang et al. 2022) over the flattened ragged batch.

Learned absolute positions with an offset of 2 (``transformers``' OPTLearnedPositionalEmbedding);
LayerNorm before (``do_layer_norm_before``, most sizes) or after (350m) each sub-block; ReLU MLP
(``fc1``, ``fc2``); optional ``project_in``/``project_out`` when ``word_embed_proj_dim != hidden``.
Parameter names are Hugging Face's without the ``decoder.`` level; ``qkv_proj`` stacks q, k, v.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from fuseserve.worker.attention import attention
from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models.layers import MergedLinear

POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        h = args.hidden_size
        self.qkv_proj = MergedLinear(h, {"q": h, "k": h, "v": h}, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``."""
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.qkv_proj.split(x))
        return self.out_proj(attention(self.layer_idx, q, k, v, self.head_dim**-0.5))


class OPTDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        cfg = args.hf
        affine = getattr(cfg, "layer_norm_elementwise_affine", True)
        bias = bool(getattr(cfg, "enable_bias", True))
        self.pre_norm = cfg.do_layer_norm_before
        self.self_attn_layer_norm = nn.LayerNorm(args.hidden_size, elementwise_affine=affine)
        self.self_attn = OPTAttention(args, layer_idx, bias)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=bias)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=bias)
        self.act = ACT2FN[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            h = x + self.self_attn(self.self_attn_layer_norm(x))
            return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))
        h = self.self_attn_layer_norm(x + self.self_attn(x))
        return self.final_layer_norm(h + self.fc2(self.act(self.fc1(h))))


class OPTDecoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        cfg = args.hf
        proj_dim = getattr(cfg, "word_embed_proj_dim", None) or args.hidden_size
        projected = proj_dim != args.hidden_size
        affine = getattr(cfg, "layer_norm_elementwise_affine", True)
        self.embed_tokens = nn.Embedding(args.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(args.max_position_embeddings + POSITION_OFFSET, args.hidden_size)
        self.project_in = nn.Linear(proj_dim, args.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(args.hidden_size, proj_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(args, i) for i in range(args.num_layers))
        final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, elementwise_affine=affine) if final else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTForCausalLM(nn.Module):
    """OPT decoder; ``forward`` over a ragged batch, ``compute_logits`` only where sampled."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    checkpoint_renames = ((r"^(model\.)?decoder\.", "model."),)
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    supports_tensor_parallel = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = OPTDecoder(args)
        self.lm_head = nn.Linear(self.model.embed_tokens.embedding_dim, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` → final hidden states ``[T, word_embed_proj_dim]``."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S', proj_dim]`` → logits ``[S', vocab]``."""
        return self.lm_head(hidden)
