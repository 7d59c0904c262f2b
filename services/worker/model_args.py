"""One normalised view of a Hugging Face config: every model file, the loader and the runner read this.

Families spell the same fact differently (``num_local_experts`` / ``num_experts``, ``hidden_act`` /
``hidden_activation`` / ``activation_function``, ``ffn_dim`` / ``intermediate_size``, a per-layer
``layer_types`` list or one ``sliding_window`` for all layers). ``ModelArgs.from_hf`` resolves each
once, with the family's defaults, as gpt-fast's ``ModelArgs.__post_init__`` derives head_dim and KV
heads in one place. Rope frequencies are still computed by ``transformers``' rope init functions from
the original config (``hf``), so every rope scaling type it knows is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and options of a decoder-only model.

    Counts are per model unless named ``num_*_per_*``; sizes are feature dimensions.
    sliding_windows: per layer, the window in tokens (a query attends to the last W positions,
        itself included) or None for full causal attention.
    attn_scale: the softmax scale, ``head_dim**-0.5`` or ``query_pre_attn_scalar**-0.5`` (Gemma 2).
    attn_logit_softcap / final_logit_softcap: Gemma 2's ``c * tanh(x / c)`` caps, None elsewhere.
    moe_layers: per layer, whether its MLP is a sparse mixture of experts.
    hf: the ``transformers`` config it came from (rope init, family-only fields such as OPT's).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    attn_scale: float
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    hf: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf(cls, config: Any) -> ModelArgs:
        """Normalise a ``transformers`` config (any supported family)."""
        archs = getattr(config, "architectures", None) or [config.model_type]
        num_layers = config.num_hidden_layers
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
        num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            architecture=archs[0],
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            norm_eps=getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-5,
            max_position_embeddings=config.max_position_embeddings,
            hidden_act=_first_attr(
                config, ("hidden_activation", "hidden_act", "activation_function"), "silu"
            ),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(config, num_layers),
            attn_scale=(scalar if scalar else head_dim) ** -0.5,
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            num_experts=num_experts,
            num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or intermediate,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            moe_layers=_moe_layers(config, num_layers, num_experts),
            hf=config,
        )


def _first_attr(config: Any, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows: from ``layer_types`` where the config has one (Gemma 2, Qwen2/3 with
    ``use_sliding_window``), else the one ``sliding_window`` for every layer (Mistral, Mixtral, Phi-3)."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * num_layers


def _moe_layers(config: Any, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Which layers are sparse: every ``decoder_sparse_step``-th, minus ``mlp_only_layers`` (Qwen MoE);
    all of them for Mixtral."""
    if not num_experts:
        return (False,) * num_layers
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
