"""Tensor parallelism over quantized checkpoints (gloo on CPU): 2 ranks' logits equal one rank's.

Each rank keeps only its slice of the packed weights, scales and zeros (column-parallel rows of
each fused part, row-parallel input columns on group boundaries); the same teacher-forced plans run
on both ranks (chunks of 7, 64 and 1 tokens packed together) and rank 0's logits are compared with
a single-process runner's within 1e-4. An act-order (GPTQ ``desc_act``) weight cannot be cut into
row-parallel slices of whole groups: refused at load, naming it.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from engine_driver import chunked_logits
from quant_checkpoints import write_quantized
from tiny_models import llama_config, random_model

from fuseserve.config import EngineConfig
from fuseserve.worker.model_runner import ModelRunner

SIZES = {1: 7, 2: 64, 3: 1, 4: 1}
CASES = {
    "gptq-4bit-g32": dict(fmt="gptq", bits=4, group=32),
    "awq-4bit-g32": dict(fmt="awq", bits=4, group=32, sym=False),
    "ct-w8a16-channel": dict(fmt="ct-int", bits=8, group=-1),
    "ct-fp8-channel": dict(fmt="ct-fp8"),
    "gptq-desc_act": dict(fmt="gptq", bits=4, group=32, desc_act=True),
}


def _runner(path) -> ModelRunner:
    from transformers import AutoConfig

    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    return ModelRunner(
        path, AutoConfig.from_pretrained(path), eos_token_ids=[0], progress=False, config=engine
    )


def _prompts(vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {
        sid: torch.randint(1, vocab, (n,), generator=g).tolist()
        for sid, n in zip(SIZES, (40, 90, 12, 5), strict=True)
    }


def _rank_main(rank: int, size: int, init_file: str, jobs: list[tuple[str, str]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        for path, out in jobs:
            try:
                runner = _runner(path)
            except Exception as e:  # the refusal is the result
                if rank == 0:
                    torch.save(f"{type(e).__name__}: {e}", out)
                continue
            packed = [m.packed for m in runner.model.modules() if hasattr(m, "packed")]
            assert packed and all(p.out_features * p.in_features > 0 for p in packed)
            logits = chunked_logits(runner, _prompts(runner.vocab_size), SIZES)
            if rank == 0:
                torch.save(
                    {"logits": logits, "shapes": [(p.out_features, p.in_features) for p in packed]}, out
                )
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one(tmp_path):
    config = llama_config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    jobs, single = [], {}
    for name, case in CASES.items():
        path = tmp_path / name
        write_quantized(random_model(config, seed=3), path, **case)
        jobs.append((str(path), str(tmp_path / f"{name}.tp2.pt")))
        runner = _runner(path)
        single[name] = (
            chunked_logits(runner, _prompts(config.vocab_size), SIZES),
            [
                (m.packed.out_features, m.packed.in_features)
                for m in runner.model.modules()
                if hasattr(m, "packed")
            ],
        )
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), jobs), nprocs=2, join=True)
    for name, (_, out) in zip(CASES, jobs, strict=True):
        got = torch.load(out)
        if name == "gptq-desc_act":
            assert isinstance(got, str) and "act-order" in got, got
            continue
        assert not isinstance(got, str), (name, got)
        one_logits, one_shapes = single[name]
        # each rank holds half of every quantized matrix: qkv / gate_up rows, o / down columns
        assert [o * i for o, i in got["shapes"]] == [o * i // 2 for o, i in one_shapes], name
        for sid, want in one_logits.items():
            err = (got["logits"][sid] - want).abs().max().item()
            assert err <= 1e-4, (name, sid, err)
