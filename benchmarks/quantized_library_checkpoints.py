"""Tiny LLaMA checkpoints quantized by llm-compressor, with ``transformers``' logits on each.

Run in a throwaway venv that has llm-compressor (it pins its own transformers; not a fuseserve
dependency). What was run here (CPU only, 2 vCPUs):

    python3 -m venv /tmp/qvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/qvenv/lib/python3.11/site-packages/zz.pth
    /tmp/qvenv/bin/pip install llmcompressor        # 0.14.0.1, compressed-tensors 0.19.0
    /tmp/qvenv/bin/python benchmarks/quantized_library_checkpoints.py /tmp/qck

then, in fuseserve's own venv, ``FUSESERVE_QUANT_LIBRARY_CHECKPOINTS=/tmp/qck pytest
tests/pipeline/test_quantized_library_checkpoints.py -s`` compares fuseserve with the logits saved
here. Each recipe's checkpoint lands in ``DIR/<name>`` with ``reference_logits.pt``: the prompts and
``transformers``' fp32 logits with the checkpoint loaded through compressed-tensors (the format's own
library decompresses it). A recipe that fails prints ``FAIL`` and the reason.

Model: LLaMA, 2 layers, hidden 128, intermediate 256, 4 heads (2 KV), vocabulary 256, random weights.
Recipes: GPTQ W4A16 (group 128, 16 random calibration sequences of 64 tokens), W4A16_ASYM and W8A16
round-to-nearest, FP8 weight-only per channel; ``lm_head`` left float.
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback

import torch


def main(root: pathlib.Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=False,
    )
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
        "llmc-w4a16-gptq": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
        "llmc-w4a16-asym-rtn": lambda: QuantizationModifier(
            targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"]
        ),
        "llmc-w8a16-rtn": lambda: QuantizationModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"]),
        "llmc-fp8-weights": lambda: QuantizationModifier(config_groups=fp8_weights, ignore=["lm_head"]),
    }
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w0", pad_token="w0")
    base = root / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(base)
    tokenizer.save_pretrained(base)
    for name, recipe in recipes.items():
        try:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            kw = dict(dataset=calib, num_calibration_samples=16, max_seq_length=64) if "gptq" in name else {}
            oneshot(model=model, recipe=recipe(), processor=tokenizer, **kw)
            out = root / name
            model.save_pretrained(out, save_compressed=True)
            tokenizer.save_pretrained(out)
            ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            with torch.no_grad():
                logits = [ref(torch.tensor([p])).logits[0].float() for p in prompts]
            torch.save({"prompts": prompts, "logits": logits}, out / "reference_logits.pt")
            qc = json.loads((out / "config.json").read_text())["quantization_config"]
            print("OK", name, qc.get("format"), next(iter(qc["config_groups"].values()))["weights"])
        except Exception as e:
            traceback.print_exc()
            print("FAIL", name, type(e).__name__, str(e)[:300])


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
