"""The one builder of tiny random checkpoints for the tests, from ``transformers`` configs.

- ``tiny_checkpoint(name, path)``: family ``name`` of ``CONFIGS`` written to ``path`` (safetensors,
  config, a word-level tokenizer of the model's vocabulary, a generation config); returns the
  ``transformers`` model holding the same weights (fp32, eager attention) with its config. Layer norms
  get random offsets so a weight the loader misses shows in the logits.
- ``add_tokenizer(hf, path)``: that tokenizer and generation config beside weights written otherwise
  (quantized checkpoints).
- ``random_model(config)`` / ``write_checkpoint(config, path)``: any config (``llama_config(**kw)``: a
  LLaMA smaller still, for loader and model-source tests), seeded, optionally saved in another dtype or
  sharded.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

EOS = 2

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

OPT = dict(
    vocab_size=512,
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    architectures=["OPTForCausalLM"],
)

CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(
        **{**TINY, "num_attention_heads": 8},
        architectures=["LlamaForCausalLM"],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "llama-tied": lambda: LlamaConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ),
    "mistral-sw16": lambda: MistralConfig(
        **TINY,
        sliding_window=16,
        architectures=["MistralForCausalLM"],
    ),
    "opt-prenorm": lambda: OPTConfig(**OPT, word_embed_proj_dim=64, do_layer_norm_before=True),
    "opt-postnorm-proj": lambda: OPTConfig(**OPT, word_embed_proj_dim=32, do_layer_norm_before=False),
    "qwen2-bias": lambda: Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"]),
    "qwen3-qknorm": lambda: Qwen3Config(**TINY, head_dim=24, architectures=["Qwen3ForCausalLM"]),
    "phi3-longrope-partial": lambda: Phi3Config(
        **{**TINY, "max_position_embeddings": 1024},
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.5],
            "long_factor": [1.5, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": 256,  # prompts stay below: see phi3.py on long factors
        },
        architectures=["Phi3ForCausalLM"],
    ),
    "gemma2-sw16-softcap": lambda: Gemma2Config(
        **{**TINY, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,  # small caps so tanh bends the random-weight scores and logits
        final_logit_softcapping=3.0,
        architectures=["Gemma2ForCausalLM"],
    ),
    "mixtral-top2of8": lambda: MixtralConfig(
        **TINY, num_local_experts=8, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]
    ),
    "qwen3moe-top3of8": lambda: Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 3},
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],  # one dense layer among the sparse ones
        architectures=["Qwen3MoeForCausalLM"],
    ),
    # the shape a divergence was reported on with transformers 5.24 (issue 23): 4 experts, top 2,
    # renormalised top-k weights (tests/pipeline/test_moe_routing.py draws prompts for it)
    "qwen3moe-top2of4-norm": lambda: Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 3},
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    ),
}


def llama_config(**overrides) -> LlamaConfig:
    """A LLaMA of 2 layers, 4 heads (2 KV heads) of 8, vocabulary 128: loader and model-source tests."""
    base = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaConfig(**{**base, **overrides})


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[1, vocab)`` by a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (length,), generator=g).tolist()


def random_model(config, seed: int = 0, perturb_norms: bool = False, dtype=torch.float32) -> torch.nn.Module:
    """The ``transformers`` model of ``config`` with seeded random weights (eager attention), in eval mode;
    ``perturb_norms``: layer norms get random offsets (a weight the loader misses then shows)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype).eval()
    if perturb_norms:
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if "norm" in pname:
                    p.add_(torch.randn_like(p) * 0.1)
    return hf


def write_checkpoint(config, path, seed: int = 0, tokenizer: bool = False, **save) -> torch.nn.Module:
    """Save ``random_model(config, seed)`` to ``path`` (``save``: ``save_pretrained``'s keywords, e.g.
    ``max_shard_size``); ``tokenizer``: also the word-level tokenizer. Returns the model."""
    hf = random_model(config, seed)
    hf.save_pretrained(path, safe_serialization=True, **save)
    if tokenizer:
        _word_tokenizer(config.vocab_size).save_pretrained(path)
    return hf


def tiny_checkpoint(name: str, path) -> tuple[torch.nn.Module, object]:
    """Write family ``name``'s tiny checkpoint to ``path``; returns ``(transformers model, config)``."""
    config = CONFIGS[name]()
    hf = random_model(config, perturb_norms=True).float()
    if name.startswith("gemma2"):  # attention scores large enough for the soft-cap's tanh to bend them
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if pname.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8.0)
    hf.save_pretrained(path, safe_serialization=True)
    add_tokenizer(hf, path)
    return hf, config


def add_tokenizer(hf, path) -> None:
    """Give ``hf`` a generation config ending at ``EOS`` and save it, with the word-level tokenizer of
    its vocabulary, to the checkpoint at ``path`` (what a pipeline needs beside the weights)."""
    hf.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=EOS)
    hf.generation_config.save_pretrained(path)
    _word_tokenizer(hf.config.vocab_size).save_pretrained(path)


def _word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token ``i`` is the word ``w{i}``; enough for prompts given as ids and for detokenizing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{EOS}")


#: the families added after LLaMA, Mistral and OPT (one configuration each)
NEW_FAMILIES = [
    "qwen2-bias",
    "qwen3-qknorm",
    "phi3-longrope-partial",
    "gemma2-sw16-softcap",
    "mixtral-top2of8",
    "qwen3moe-top3of8",
]
