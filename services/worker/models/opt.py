"""OPT (Zhang et al. 2022) over the flattened ragged batch.

Learned absolute positions with an offset of 2 (``transformers``' OPTLearnedPositionalEmbedding);
LayerNorm before (``do_layer_norm_before``, most sizes) or after (350m) each sub-block; ReLU MLP
(``fc1``, ``fc2``); optional ``project_in``/``project_out`` when ``word_embed_proj_dim != hidden``.
``wqkv`` holds the q, k, v projections stacked (one GEMM).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

from fuseserve.worker.attention import attention
from fuseserve.worker.models.layers import copy_into

POSITION_OFFSET = 2


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=bias)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``."""
        q, k, v = (t.view(-1, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        return self.wo(attention(self.layer_idx, q, k, v, self.scale))


class Block(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        bias = bool(getattr(config, "enable_bias", True))
        self.pre_norm = config.do_layer_norm_before
        self.attention_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=bias)
        self.act = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            h = x + self.attention(self.attention_norm(x))
            return h + self.fc2(self.act(self.fc1(self.ffn_norm(h))))
        h = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(h + self.fc2(self.act(self.fc1(h))))


class OPTForCausalLM(nn.Module):
    """OPT decoder; ``forward`` over a ragged batch, ``compute_logits`` only where sampled."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        proj_dim = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        self.tok_embeddings = nn.Embedding(config.vocab_size, proj_dim)
        self.pos_embeddings = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, config.hidden_size
        )
        self.project_in = (
            nn.Linear(proj_dim, config.hidden_size, bias=False) if proj_dim != config.hidden_size else None
        )
        self.project_out = (
            nn.Linear(config.hidden_size, proj_dim, bias=False) if proj_dim != config.hidden_size else None
        )
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine) if final else None
        self.output = nn.Linear(proj_dim, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` → final hidden states ``[T, word_embed_proj_dim]``."""
        x = self.tok_embeddings(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.pos_embeddings(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S', proj_dim]`` → logits ``[S', vocab]``."""
        return self.output(hidden)

    _PER_LAYER = {
        "self_attn_layer_norm": "attention_norm",
        "final_layer_norm": "ffn_norm",
        "self_attn.out_proj": "attention.wo",
        "fc1": "fc1",
        "fc2": "fc2",
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the model; returns the parameter names filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        top = {
            "embed_tokens": "tok_embeddings",
            "embed_positions": "pos_embeddings",
            "project_in": "project_in",
            "project_out": "project_out",
            "final_layer_norm": "norm",
        }
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            rows = None
            if name.startswith("lm_head."):
                target = "output." + name.split(".", 1)[1]
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                stem, kind = rest.rsplit(".", 1)
                if stem in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                    h = self.config.hidden_size
                    part = "qkv".index(stem[-6])
                    target, rows = f"layers.{idx}.attention.wqkv.{kind}", slice(part * h, (part + 1) * h)
                elif stem in self._PER_LAYER:
                    target = f"layers.{idx}.{self._PER_LAYER[stem]}.{kind}"
                else:
                    continue
            else:
                stem, kind = name.rsplit(".", 1)
                if stem not in top:
                    continue
                target = f"{top[stem]}.{kind}"
            if target in params:
                copy_into(params[target], tensor, name, rows)
                filled.add(target if rows is None else f"{target}:{name}")
        if "output.weight" not in filled and getattr(self.config, "tie_word_embeddings", True):
            self.output.weight = self.tok_embeddings.weight
            filled.add("output.weight")
        return filled
