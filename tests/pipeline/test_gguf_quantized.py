"""SmolLM2-135M-Instruct served from its GGUF weights kept quantized (``quantization="gguf"``).

The bundled file is Q4_1 (the token embedding, tied to the LM head, Q8_0). Checked against the
float32 conversion everything else is tested on: the repacked weights dequantize to exactly its
weights; greedy tokens equal ``transformers.generate`` on the float32 conversion under the fp32
near-tie rule (``greedy_check``), prompts in chunks of 16 tokens packed together; the resident weights
are at most 0.35x the float32 model's (``pytest -s`` prints both).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from greedy_check import assert_matches, hf_greedy

NEW_TOKENS = 24
CHATS = ["What is the capital of France?", "Hi!", "Write a haiku about the sea.", "List three prime numbers."]
PLAIN = [
    "The capital of France is",  # README
    "Once upon a time",  # README
    "The quick brown fox jumps over the lazy dog. Then the dog",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


@pytest.fixture(scope="module")
def quantized_source():
    from fuseserve.model_source import resolve_model

    cache = os.environ.get("FUSESERVE_CACHE") or pathlib.Path.home() / ".cache" / "fuseserve"
    return resolve_model("smollm2-135m-instruct", cache_dir=cache, quantization="gguf", progress=False)


def test_repacked_weights_dequantize_to_the_float32_conversion(quantized_source, smollm2_source):
    from safetensors.torch import load_file

    assert quantized_source.path != smollm2_source.path
    q = load_file(quantized_source.path / "model.safetensors")
    f = load_file(smollm2_source.path / "model.safetensors")
    modules = json.loads((quantized_source.path / "config.json").read_text())["quantization_config"][
        "modules"
    ]
    assert {m["type"] for m in modules.values()} == {"Q4_1", "Q8_0"}
    assert len(modules) == 30 * 7 + 2  # every projection, the embedding and the (tied) LM head
    for name, spec in modules.items():
        qw, g = q[f"{name}.qweight"].float(), spec["group_size"]
        n, k = qw.shape
        w = (qw.view(n, k // g, g) * q[f"{name}.scales"][..., None] + q[f"{name}.offsets"][..., None]).view(
            n, k
        )
        ref = f["model.embed_tokens.weight"] if name == "lm_head" else f[f"{name}.weight"]
        assert torch.equal(w, ref), name
    for name, tensor in q.items():
        if name.endswith(".weight"):  # norms stay float
            assert torch.equal(tensor, f[name]), name


@pytest.fixture(scope="module")
def pipe(quantized_source):
    import fuseserve

    p = fuseserve.pipeline(
        str(quantized_source.path), token_budget=16, kv_cache_memory="256MiB", dtype="float32", progress=False
    )
    yield p
    p.close()


def test_quantized_layers_and_resident_bytes(pipe, smollm2_source):
    from safetensors.torch import load_file

    from fuseserve.worker.quantization import weight_bytes

    model = pipe.runner.model
    names = {type(m).__name__ for m in model.modules()}
    assert {"QuantizedMergedLinear", "QuantizedRowParallelLinear", "QuantizedParallelLMHead"} <= names
    assert "QuantizedVocabParallelEmbedding" in names
    fp32 = sum(t.numel() * 4 for t in load_file(smollm2_source.path / "model.safetensors").values())
    ours = weight_bytes(model)
    print(
        f"\nresident weights: quantized {ours / 2**20:.1f} MiB, fp32 {fp32 / 2**20:.1f} MiB, ratio {ours / fp32:.3f}"
    )
    assert ours <= 0.35 * fp32


@pytest.mark.slow  # SmolLM2 greedy on 8 prompts twice (~19 s); CI runs it (./dev.sh test-slow)
def test_greedy_equals_transformers_on_the_float32_conversion(pipe, smollm2_source):
    from transformers import AutoModelForCausalLM

    from fuseserve.frontend.model_info import build_encoder, load_tokenizer

    tokenizer = load_tokenizer(smollm2_source)
    encoder = build_encoder(smollm2_source, tokenizer)
    prompts = [encoder.chat([{"role": "user", "content": c}]) for c in CHATS]
    prompts += [tokenizer(p)["input_ids"] for p in PLAIN]
    outs = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.path, dtype=torch.float32).eval()
    same = 0
    for ids, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, ids, NEW_TOKENS)
        assert_matches(list(out.token_ids), ref_tokens, ref_logits, what=tokenizer.decode(ids)[-40:])
        same += list(out.token_ids) == ref_tokens
    print(f"\n{same}/{len(prompts)} prompts token-identical to transformers' fp32 greedy")
