"""Quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors) against ``transformers``.

Each case writes a tiny LLaMA (2 layers, hidden 64), or a tiny Mixtral / Qwen3-MoE with every expert
quantized, in the format's on-disk layout (``tests/quant_checkpoints.py``) and loads it into
``transformers`` with the dequantized weights: the weights the checkpoint encodes. fuseserve's logits
(fp32 compute), with the prompt in chunks of 16 tokens packed beside two other sequences, are within
1e-3 of transformers' relative to the largest logit (``pytest -s`` prints each error); a mixture of
experts up to a router near-tie, where fp32 rounding may pick either expert. Its greedy tokens
through the pipeline equal transformers' under the near-tie rules (``greedy_check``).
An unsupported scheme or bit width fails at load, named.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from greedy_check import ROUTER_TIE, assert_moe_matches, hf_greedy, router_gaps
from pipeline_harness import wait_all_free
from quant_checkpoints import write_quantized
from tiny_models import CONFIGS, add_tokenizer, llama_config, random_model, random_prompt

from fuseserve.config import EngineConfig
from fuseserve.errors import UnsupportedModelError
from fuseserve.worker.model_runner import ModelRunner
from fuseserve.worker.quantization import is_quantized, weight_bytes

RTOL = 1e-3

CASES = {
    "gptq-4bit-g32-sym": dict(fmt="gptq", bits=4, group=32),
    "gptq-4bit-g64-asym": dict(fmt="gptq", bits=4, group=64, sym=False),
    "gptq-4bit-g32-desc_act": dict(fmt="gptq", bits=4, group=32, desc_act=True),
    "gptq-8bit-perchannel": dict(fmt="gptq", bits=8, group=-1),
    "gptq-8bit-g32-asym-v2": dict(fmt="gptq", bits=8, group=32, sym=False, v2=True),
    "awq-4bit-g32": dict(fmt="awq", bits=4, group=32, sym=False),
    "ct-w4a16-g32": dict(fmt="ct-int", bits=4, group=32),
    "ct-w4a16-g32-asym-actorder": dict(fmt="ct-int", bits=4, group=32, sym=False, actorder=True),
    "ct-w8a16-channel": dict(fmt="ct-int", bits=8, group=-1),
    "ct-fp8-channel": dict(fmt="ct-fp8"),
    "ct-fp8-tensor": dict(fmt="ct-fp8", strategy="tensor"),
}
MOE_FAMILIES = ["mixtral-top2of8", "qwen3moe-top3of8"]  # 8 experts each; Qwen3-MoE has one dense layer
MOE_CASES = {
    "gptq-4bit-g32": dict(fmt="gptq", bits=4, group=32),
    "gptq-4bit-g32-desc_act": dict(fmt="gptq", bits=4, group=32, desc_act=True),
    "awq-4bit-g32": dict(fmt="awq", bits=4, group=32, sym=False),
    "ct-w8a16-channel": dict(fmt="ct-int", bits=8, group=-1),
    "ct-w4a16-g32-asym": dict(fmt="ct-int", bits=4, group=32, sym=False),
    "ct-fp8-channel": dict(fmt="ct-fp8"),
}


def _config():
    return llama_config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def _runner(path, config):
    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    return ModelRunner(path, config, eos_token_ids=[0], config=engine, progress=False)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_the_dequantized_weights(case, tmp_path):
    config = _config()
    hf = random_model(config, seed=3)
    before = hf.model.layers[0].mlp.down_proj.weight.detach().clone()
    config.quantization_config = write_quantized(hf, tmp_path, **CASES[case])
    assert not torch.equal(before, hf.model.layers[0].mlp.down_proj.weight)  # the reference is quantized
    runner = _runner(tmp_path, config)
    quantized = [n for n, m in runner.model.named_modules() if hasattr(m, "packed")]
    assert len(quantized) == 2 * 4, quantized  # qkv, o, gate_up, down per layer; the LM head float
    worst = _max_relative_error(runner, hf)
    print(f"\n{case}: max |fuseserve - transformers| / max |logit| = {worst:.2e}")
    assert worst <= RTOL


def _max_relative_error(runner, hf, moe: bool = False) -> float:
    """Three prompts (70, 40, 5 tokens) in chunks of 16, 16 and 1 packed together: the largest
    |fuseserve - transformers| logit over the largest |logit| of transformers', per prompt. ``moe``: a
    prompt whose error exceeds ``RTOL`` is compared only up to its first router near-tie
    (``greedy_check.ROUTER_TIE``: from there either expert may be chosen); at least 3/4 of the
    positions must be compared."""
    v = hf.config.vocab_size
    prompts = {1: random_prompt(1, 70, v), 2: random_prompt(2, 40, v), 3: random_prompt(3, 5, v)}
    ours = chunked_logits(runner, prompts, {1: 16, 2: 16, 3: 1})
    worst, compared = 0.0, 0
    for sid, tokens in prompts.items():
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float()
        err = (ours[sid] - ref).abs().amax(-1) / ref.abs().max()  # [len]
        if moe and err.max() > RTOL:
            ties = (router_gaps(hf, tokens) < ROUTER_TIE).nonzero().flatten().tolist()
            print(f"\nprompt {sid}: error {err.max():.2e} from token {int((err > RTOL).nonzero()[0])}, "
                  f"router near-ties at tokens {ties}; compared before the first")  # fmt: skip
            err = err[: ties[0] if ties else len(tokens)]
        compared += len(err)
        worst = max([worst, *err.tolist()])
    assert compared >= 0.75 * sum(map(len, prompts.values())), f"guard: {compared} positions compared"
    return worst


@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_experts_match_transformers_on_the_dequantized_weights(family, case, tmp_path):
    config = CONFIGS[family]()
    hf = random_model(config, seed=3)
    before = hf.model.layers[0].mlp.experts.down_proj.detach().clone()
    config.quantization_config = write_quantized(hf, tmp_path, **MOE_CASES[case])
    assert not torch.equal(before, hf.model.layers[0].mlp.experts.down_proj)  # the reference is quantized
    runner = _runner(tmp_path, config)
    experts = [m for m in runner.model.modules() if hasattr(m, "packed_experts")]
    assert len(experts) == 2 and all(len(m.packed_experts) == 8 for m in experts), experts
    expert_bytes = sum(p.nbytes() for m in experts for pair in m.packed_experts for p in pair)
    float_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert weight_bytes(runner.model) >= float_bytes + expert_bytes  # the packed experts are counted
    routers = [m for n, m in runner.model.named_modules() if n.endswith("mlp.gate")]
    assert routers and not any(is_quantized(m) for m in routers)  # the router stays float
    worst = _max_relative_error(runner, hf, moe=True)
    print(f"\n{family} {case}: max |fuseserve - transformers| / max |logit| = {worst:.2e}")
    assert worst <= RTOL


@pytest.mark.parametrize(
    "family,case", [("mixtral-top2of8", "gptq-4bit-g32"), ("qwen3moe-top3of8", "ct-w8a16-channel")]
)
def test_quantized_experts_greedy_matches_transformers(family, case, tmp_path):
    """Four prompts (3 to 40 tokens) through the pipeline with a 16-token budget: chunked and packed."""
    import fuseserve

    config = CONFIGS[family]()
    hf = random_model(config, seed=3)
    write_quantized(hf, tmp_path, **MOE_CASES[case])
    add_tokenizer(hf, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 29, 40)]
    pipe = fuseserve.pipeline(
        str(tmp_path), token_budget=16, kv_cache_memory="8MiB", device="cpu", dtype="float32", progress=False
    )
    try:
        outs = pipe(prompts, max_new_tokens=12, temperature=0.0)
        wait_all_free(pipe)
    finally:
        pipe.close()
    assert sum(len(r.token_ids) for r in outs) > 2 * len(prompts), "guard: generation must not stop at once"
    for i, (ids, r) in enumerate(zip(prompts, outs, strict=True)):
        assert_moe_matches(hf, ids, r.token_ids, *hf_greedy(hf, ids, 12), what=f"{family} {case} prompt {i}")


def test_quantized_weights_are_not_the_float_ones(tmp_path):
    """The check above can fail: a checkpoint whose scales are doubled gives other logits."""
    from safetensors.torch import load_file, save_file

    config = _config()
    hf = random_model(config, seed=3)
    config.quantization_config = write_quantized(hf, tmp_path, fmt="gptq", bits=4, group=32)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.scales"
    state[name] = state[name] * 2
    save_file(state, str(tmp_path / "model.safetensors"), {"format": "pt"})
    runner = _runner(tmp_path, config)
    tokens = random_prompt(1, 20, config.vocab_size)
    ours = chunked_logits(runner, {1: tokens}, {1: 16})[1]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    assert ((ours - ref).abs().max() / ref.abs().max()) > RTOL


@pytest.mark.parametrize(
    "qc,named",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "3-bit"),
        ({"quant_method": "awq", "bits": 8, "group_size": 32, "version": "gemm"}, "8-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "gemv"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "type": "int"}}},
            },
            "3-bit",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                    }
                },
            },
            "activation quantization",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
            },
            "nvfp4",
        ),
    ],
)
def test_unsupported_schemes_are_refused_by_name(qc, named, tmp_path):
    config = _config()
    hf = random_model(config, seed=3)
    write_quantized(hf, tmp_path, fmt="gptq", bits=4, group=32)
    config.quantization_config = qc
    with pytest.raises(UnsupportedModelError, match=named):
        _runner(tmp_path, config)
