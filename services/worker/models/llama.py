"""LLaMA / LLaMA-2 / LLaMA-3 over the flattened ragged batch (Touvron et al. 2023).

Pre-norm decoder: ``h = x + Attn(RMSNorm(x))``, ``out = h + SwiGLU(RMSNorm(h))``; grouped-query
attention; rotary positions with the config's rope scaling. ``wqkv`` holds q, k, v projections
stacked (one GEMM) and ``w13`` the gate (w1) and up (w3) projections stacked.
Mistral is this model with a sliding window (``mistral.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fuseserve.worker.attention import attention
from fuseserve.worker.models.layers import RMSNorm, Rotary, copy_into


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: Rotary, sliding_window: int | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.wo = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``."""
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.n_heads, self.head_dim)
        k = k.view(-1, self.n_kv_heads, self.head_dim)
        v = v.view(-1, self.n_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions)
        return self.wo(attention(self.layer_idx, q, k, v, self.scale, sliding_window=self.sliding_window))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.inter = config.intermediate_size
        self.w13 = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.w2 = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: Rotary, sliding_window: int | None):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_idx, rotary, sliding_window)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` over a ragged batch, ``compute_logits`` only where sampled."""

    uses_sliding_window = False  # Mistral: every layer attends to the last ``config.sliding_window`` tokens

    def __init__(self, config):
        super().__init__()
        self.config = config
        window = getattr(config, "sliding_window", None) if self.uses_sliding_window else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = Rotary(config, head_dim, config.max_position_embeddings)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, rotary, window) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` → final hidden states ``[T, hidden]``.

        Attention metadata comes from the enclosing ``forward_context``.
        """
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S', hidden]`` → logits ``[S', vocab]``."""
        return self.output(hidden)

    # ----- weights: Hugging Face names → ours -----
    _PER_LAYER = {
        "input_layernorm.weight": ("attention_norm.weight", None),
        "post_attention_layernorm.weight": ("ffn_norm.weight", None),
        "self_attn.o_proj.weight": ("attention.wo.weight", None),
        "self_attn.o_proj.bias": ("attention.wo.bias", None),
        "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
        "mlp.down_proj.bias": ("feed_forward.w2.bias", None),
        "self_attn.q_proj": ("attention.wqkv", "q"),
        "self_attn.k_proj": ("attention.wqkv", "k"),
        "self_attn.v_proj": ("attention.wqkv", "v"),
        "mlp.gate_proj": ("feed_forward.w13", "gate"),
        "mlp.up_proj": ("feed_forward.w13", "up"),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the model; returns the parameter names filled.

        Raises ``ValueError`` on a shape mismatch. Unknown names (e.g. rotary buffers) are skipped.
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            target, rows = self._map(name)
            if target is None or target not in params:
                continue
            copy_into(params[target], tensor, name, rows)
            filled.add(target if rows is None else f"{target}:{name}")
        if "output.weight" not in filled and getattr(self.config, "tie_word_embeddings", False):
            self.output.weight = self.tok_embeddings.weight
            filled.add("output.weight")
        return filled

    def _map(self, name: str) -> tuple[str | None, slice | None]:
        if name in ("model.embed_tokens.weight",):
            return "tok_embeddings.weight", None
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return "output.weight", None
        if not name.startswith("model.layers."):
            return None, None
        idx, rest = name[len("model.layers.") :].split(".", 1)
        if rest in self._PER_LAYER:
            return f"layers.{idx}.{self._PER_LAYER[rest][0]}", None
        stem, kind = rest.rsplit(".", 1)  # e.g. ("self_attn.q_proj", "weight")
        if stem not in self._PER_LAYER:
            return None, None
        target, part = self._PER_LAYER[stem]
        attn = self.layers[int(idx)].attention
        ffn = self.layers[int(idx)].feed_forward
        offsets = {
            "q": (0, attn.q_size),
            "k": (attn.q_size, attn.kv_size),
            "v": (attn.q_size + attn.kv_size, attn.kv_size),
            "gate": (0, ffn.inter),
            "up": (ffn.inter, ffn.inter),
        }
        start, size = offsets[part]
        return f"layers.{idx}.{target}.{kind}", slice(start, start + size)
