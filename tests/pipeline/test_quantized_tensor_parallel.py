"""Tensor parallelism over quantized checkpoints (gloo on CPU): 2 ranks' logits equal one rank's.

Each rank keeps only its slice of the packed weights, scales and zeros (column-parallel rows of
each fused part, row-parallel input columns on group boundaries); the same teacher-forced plans run
on both ranks (chunks of 7, 64 and 1 tokens packed together) and rank 0's logits are compared with
a single-process runner's within 1e-4. An act-order (GPTQ ``desc_act``) weight cannot be cut into
row-parallel slices of whole groups: refused at load, naming it.

Quantized experts (tiny Mixtral, Qwen3-MoE) split the same way: each rank keeps the rows of gate and up
and the columns of down of its half of every expert's intermediate features. Experts 96 features wide
quantized in groups of 32 give a rank 48 columns of down, which split a group: refused, naming it.
"""

from __future__ import annotations

from quant_checkpoints import write_quantized
from tiny_models import CONFIGS, llama_config, random_model
from tp_harness import one_rank, spawn_ranks

CASES = {
    "gptq-4bit-g32": dict(fmt="gptq", bits=4, group=32),
    "awq-4bit-g32": dict(fmt="awq", bits=4, group=32, sym=False),
    "ct-w8a16-channel": dict(fmt="ct-int", bits=8, group=-1),
    "ct-fp8-channel": dict(fmt="ct-fp8"),
    "gptq-desc_act": dict(fmt="gptq", bits=4, group=32, desc_act=True),
}
MOE_CASES = {  # name: (family, config overrides, format)
    "mixtral-gptq-4bit-g32": ("mixtral-top2of8", {}, dict(fmt="gptq", bits=4, group=32)),
    "mixtral-ct-w8a16-channel": ("mixtral-top2of8", {}, dict(fmt="ct-int", bits=8, group=-1)),
    "qwen3moe-ct-w4a16-g16": ("qwen3moe-top3of8", {}, dict(fmt="ct-int", bits=4, group=16)),
    "qwen3moe-96-gptq-4bit-g32": (
        "qwen3moe-top3of8",
        {"moe_intermediate_size": 96},
        dict(fmt="gptq", bits=4, group=32),
    ),
}


def _packed_shapes(runner) -> list[tuple[int, int]]:
    """(out, in) features of every quantized layer's packed weight on this rank (experts: each one's
    gate_up and down)."""
    modules = list(runner.model.modules())
    packed = [m.packed for m in modules if hasattr(m, "packed")]
    packed += [p for m in modules for pair in getattr(m, "packed_experts", ()) for p in pair]
    assert packed and all(p.out_features * p.in_features > 0 for p in packed)
    return [(p.out_features, p.in_features) for p in packed]


def test_two_ranks_equal_one(tmp_path):
    config = llama_config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    names = [*CASES, *MOE_CASES]
    paths = [tmp_path / name for name in names]
    for case, path in zip(CASES.values(), paths[: len(CASES)], strict=True):
        write_quantized(random_model(config, seed=3), path, **case)
    for (family, overrides, case), path in zip(MOE_CASES.values(), paths[len(CASES) :], strict=True):
        moe_config = CONFIGS[family]()
        moe_config.update(overrides)
        write_quantized(random_model(moe_config, seed=3), path, **case)
    single = {name: one_rank(path, _packed_shapes) for name, path in zip(names, paths, strict=True)}
    tp = spawn_ranks(2, paths, tmp_path, inspect=_packed_shapes)
    for name, got in zip(names, tp, strict=True):
        if name == "gptq-desc_act":
            assert isinstance(got, str) and "act-order" in got, got
            continue
        if name == "qwen3moe-96-gptq-4bit-g32":
            assert isinstance(got, str) and "down projection" in got and "groups of 32" in got, got
            continue
        assert not isinstance(got, str), (name, got)
        one = single[name]
        # each rank holds half of every quantized matrix: qkv / gate_up rows, o / down columns
        assert [o * i for o, i in got["inspect"]] == [o * i // 2 for o, i in one["inspect"]], name
        for sid, want in one["logits"].items():
            err = (got["logits"][sid] - want).abs().max().item()
            assert err <= 1e-4, (name, sid, err)
