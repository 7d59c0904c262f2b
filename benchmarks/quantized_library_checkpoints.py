"""Tiny LLaMA, Qwen2 and Mixtral checkpoints quantized by llm-compressor, with ``transformers``' logits.

Run in a throwaway venv that has llm-compressor (it pins its own transformers; not a fuseserve
dependency). What was run here (CPU only, 2 vCPUs):

    python3 -m venv /tmp/qvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/qvenv/lib/python3.11/site-packages/zz.pth
    /tmp/qvenv/bin/pip install llmcompressor   # 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0
    /tmp/qvenv/bin/python benchmarks/quantized_library_checkpoints.py /tmp/qck [FAMILY ...]

(torch 2.13.0+cpu comes from fuseserve's venv through the ``.pth``; llm-compressor pins
transformers<=5.17.0, so the venv holds its own 5.17.0 in front of fuseserve's.) Then, in fuseserve's
own venv, ``FUSESERVE_QUANT_LIBRARY_CHECKPOINTS=/tmp/qck pytest
tests/pipeline/test_quantized_library_checkpoints.py -s`` compares fuseserve with the logits saved
here. Each checkpoint lands in ``DIR/<family>-<recipe>`` with ``reference_logits.pt``: the prompts and
``transformers``' fp32 logits with the checkpoint loaded through compressed-tensors (the format's own
library decompresses it); ``DIR/<family>-base`` holds the float model. A recipe that fails prints
``FAIL`` and the reason; all 12 succeeded here.

Models (random weights): 2 layers, hidden 128, intermediate 256, 4 heads (2 KV), vocabulary 256.
LLaMA; Qwen2 (q/k/v biases, drawn N(0, 0.5) since its init zeroes them); Mixtral (4 experts, top-2).
Recipes: GPTQ W4A16 (group 128, 16 random calibration sequences of 64 tokens), W4A16_ASYM and W8A16
round-to-nearest, FP8 weight-only per channel; ``lm_head`` and Mixtral's router left float.

Mixtral: transformers 5 holds the experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]); ``oneshot`` linearizes them into per-expert ``Linear``s first, so the experts are quantized,
and saves them as ``model.layers.<l>.block_sparse_moe.experts.<e>.{gate,up,down}_proj`` (not the
original ``w1/w3/w2``); the router stays ``block_sparse_moe.gate.weight``. See ``load_reference``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
"""family -> (transformers config class, architecture, fields beyond the shared tiny shape)."""

# lm_head stays float everywhere; Mixtral's router (``mlp.gate`` in transformers 5, ``block_sparse_moe.gate``
# in the checkpoints) too -- it is no ``Linear`` there, the patterns only make that explicit.
IGNORE = ["lm_head", "re:.*block_sparse_moe.gate$", "re:.*mlp.gate$"]


def tiny_model(family: str) -> torch.nn.Module:
    """The family's tiny model with random weights; Qwen2's q/k/v biases random too (init makes them 0)."""
    import transformers

    config_cls, arch, extra = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=[arch],
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    return model


def load_reference(path: pathlib.Path, base: pathlib.Path, family: str) -> torch.nn.Module:
    """``transformers``' model of a saved checkpoint, compressed-tensors decompressing it.

    llm-compressor splits transformers 5's fused Mixtral experts (``mlp.experts.gate_up_proj`` [E, 2I, H])
    into per-expert ``Linear``s (``linearize_moe``) and saves them as
    ``block_sparse_moe.experts.<e>.{gate,up,down}_proj``, a layout a plain ``from_pretrained`` leaves out
    (its experts stay random, "MISSING"). llm-compressor's loader for it (``patch_moe_mappings`` +
    ``load_quantizable_moe``) fails in transformers 5.17 without torchvision (``apply_patches`` imports
    every image processor), and no CPU torchvision was reachable. So for Mixtral this runs transformers'
    compressed-tensors load by hand: the float model linearized as llm-compressor does, the config applied
    and compressed, the checkpoint's tensors loaded (strict), then decompressed.
    """
    from transformers import AutoModelForCausalLM

    if family != "mixtral":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from safetensors.torch import load_file
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = CompressedTensorsConfig.from_dict(
        json.loads((path / "config.json").read_text())["quantization_config"]
    )
    model = linearize_moe(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    compressor = ModelCompressor.from_compression_config(config)
    apply_quantization_config(model, compressor.quantization_config, run_compressed=False)
    compressor.compress_model(model)
    state = {
        k.replace(".block_sparse_moe.", ".mlp."): v
        for f in path.glob("*.safetensors")
        for k, v in load_file(f).items()
    }
    model.load_state_dict(state, strict=True)
    compressor.decompress_model(model)
    return model.eval()


def main(root: pathlib.Path, families: list[str]) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (70, 33, 5)]
    calib = Dataset.from_dict(
        {
            "input_ids": [torch.randint(1, 256, (64,), generator=g).tolist() for _ in range(16)],
            "attention_mask": [[1] * 64 for _ in range(16)],
        }
    )
    fp8_weights = {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
        }
    }
    recipes = {
        "w4a16-gptq": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE),
        "w4a16-asym-rtn": lambda: QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=IGNORE),
        "w8a16-rtn": lambda: QuantizationModifier(targets="Linear", scheme="W8A16", ignore=IGNORE),
        "fp8-weights": lambda: QuantizationModifier(config_groups=fp8_weights, ignore=IGNORE),
    }
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w0", pad_token="w0")
    for family in families:
        base = root / f"{family}-base"
        tiny_model(family).save_pretrained(base)
        tokenizer.save_pretrained(base)
        for recipe_name, recipe in recipes.items():
            name = f"{family}-{recipe_name}"
            try:
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                kw = (
                    dict(dataset=calib, num_calibration_samples=16, max_seq_length=64)
                    if "gptq" in name
                    else {}
                )
                oneshot(model=model, recipe=recipe(), processor=tokenizer, **kw)
                out = root / name
                model.save_pretrained(out, save_compressed=True)
                tokenizer.save_pretrained(out)
                ref = load_reference(out, base, family)
                with torch.no_grad():
                    logits = [ref(torch.tensor([p])).logits[0].float() for p in prompts]
                torch.save({"prompts": prompts, "logits": logits}, out / "reference_logits.pt")
                qc = json.loads((out / "config.json").read_text())["quantization_config"]
                print("OK", name, qc.get("format"), next(iter(qc["config_groups"].values()))["weights"])
            except Exception as e:
                traceback.print_exc()
                print("FAIL", name, type(e).__name__, str(e)[:300])


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:] or list(FAMILIES))
