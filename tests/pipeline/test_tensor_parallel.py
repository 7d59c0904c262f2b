"""Tensor parallelism inside a worker (gloo on CPU): logits with N ranks equal one rank's within 1e-4.

Every LLaMA-shaped family's tiny checkpoint (``tiny_models``) runs on 2 ranks, and LLaMA with 8
heads / 2 KV heads also on 4 ranks (each KV head replicated on 2 ranks). All ranks run the same
teacher-forced plans (sequences in chunks of 7, 64 and 1 tokens packed in the same passes); rank 0's
logits are compared with a single-process runner's. SmolLM2-135M (9 heads, 3 KV heads) on 3 ranks
decodes greedily to the same tokens as on one (near-tie rule of ``greedy_check``).

These run the model runner directly on every rank; the worker's rank-0 plan broadcast is not here.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from engine_driver import free, greedy_tokens, with_blocks
from greedy_check import assert_matches
from tiny_models import NEW_FAMILIES, tiny_checkpoint
from tp_harness import assert_logits_close, one_rank, spawn_ranks, tp_prompts, tp_runner

from fuseserve.config import EngineConfig

ATOL = 1e-4
TP2_FAMILIES = ["llama-gqa", "llama-tied", *NEW_FAMILIES]


def _embedding_rows(runner) -> tuple[int, int]:
    """(embedding rows on this rank, vocabulary): a sharded embedding holds vocab / ranks rows."""
    return runner.model.model.embed_tokens.num_embeddings, runner.vocab_size


def _run_tp(size: int, names: list[str], tmp_path) -> dict[str, tuple[dict, dict]]:
    """Per family: (rank 0's result with ``size`` ranks, one process's)."""
    paths = [tmp_path / name for name in names]
    for name, path in zip(names, paths, strict=True):
        tiny_checkpoint(name, path)
    single = [one_rank(path) for path in paths]
    assert not any(isinstance(one, str) for one in single), single
    tp = spawn_ranks(size, paths, tmp_path, inspect=_embedding_rows)
    for name, got in zip(names, tp, strict=True):
        assert not isinstance(got, str), (name, got)
        rows, vocab = got["inspect"]
        assert rows == vocab // size, f"{name}: embedding not sharded"
    return dict(zip(names, zip(tp, single, strict=True), strict=True))


def _assert_equal(results) -> None:
    for name, (tp, one) in results.items():
        assert_logits_close(tp["logits"], one["logits"], ATOL, name)


def test_tp2_equals_tp1(tmp_path):
    _assert_equal(_run_tp(2, TP2_FAMILIES, tmp_path))


@pytest.mark.slow
def test_tp4_with_replicated_kv_heads_equals_tp1(tmp_path):
    _assert_equal(_run_tp(4, ["llama-gqa"], tmp_path))


SMOL_PROMPT = "The history of the city begins in the year"


def _smol_rank_main(rank: int, size: int, init_file: str, path: str, prompt: list[int], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tokens, _ = greedy_tokens(tp_runner(path), prompt, 16)
        if rank == 0:
            torch.save(tokens, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_smollm2_tp3_greedy_equals_tp1(smollm2_source, tmp_path):
    prompt = smollm2_source.load_tokenizer()(SMOL_PROMPT)["input_ids"]
    ref_tokens, ref_logits = greedy_tokens(tp_runner(smollm2_source.path), prompt, 16)
    out = str(tmp_path / "tp3.pt")
    mp.spawn(
        _smol_rank_main,
        args=(3, str(tmp_path / "init"), str(smollm2_source.path), prompt, out),
        nprocs=3,
        join=True,
    )
    assert_matches(torch.load(out), ref_tokens, ref_logits, what="SmolLM2 TP=3")


def test_worker_runner_broadcasts_plans_and_stops_ranks(tmp_path):
    """``tensor_parallel.start``: rank 0 here, rank 1 spawned; ``step`` with decode entries that carry
    no token (as the scheduler sends them), one of them a 3-pass plan, samples the same greedy tokens
    as one process."""
    from transformers import AutoConfig

    from fuseserve.sampling_params import SamplingParams
    from fuseserve.types import SeqChunk, StepPlan
    from fuseserve.worker import parallel, tensor_parallel

    tiny_checkpoint("qwen3-qknorm", tmp_path)
    prompt = tp_prompts(512)[1]
    ref_tokens, ref_logits = greedy_tokens(tp_runner(tmp_path), prompt, 8, chunk=len(prompt))
    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    runner = tensor_parallel.start(tmp_path, AutoConfig.from_pretrained(tmp_path), [0], engine, 2, threads=1)
    try:
        assert parallel.world() == (0, 2)
        first = SeqChunk(7, 0, len(prompt), prompt, True, SamplingParams(temperature=0.0), len(prompt))
        tokens = [runner.step(with_blocks(runner, StepPlan(0, [first]))).tokens[0].token_id]
        # a multi-step plan (``multi_pass_run.run_passes``): 3 passes, each broadcast as one pass; the
        # prompt's last block holds their positions
        multi = StepPlan(1, [SeqChunk(7, len(prompt), 1, [], True, None, len(prompt))], num_passes=3)
        result = runner.step(multi)
        assert result.num_passes == 3
        tokens += [t.token_id for t in result.tokens]
        for i in range(4, 8):
            decode = SeqChunk(7, len(prompt) + i - 1, 1, [], True, None, len(prompt))
            tokens.append(runner.step(with_blocks(runner, StepPlan(i, [decode]))).tokens[0].token_id)
        free(runner, [7])
        assert runner.num_free_blocks == runner.info.num_blocks
    finally:
        runner.close()
    assert parallel.world() == (0, 1)
    assert all(not p.is_alive() for p in runner.followers)
    assert_matches(tokens, ref_tokens, ref_logits, what="TP=2 worker runner")


def test_pipeline_tensor_parallel_2_greedy_equals_one_rank(tmp_path):
    """``fuseserve.pipeline(..., tensor_parallel_size=2)`` (vLLM's ``LLM(tensor_parallel_size=)``):
    rank 1 in a process of its own, the same greedy tokens as one rank on a tiny LLaMA (GQA)."""
    import fuseserve

    tiny_checkpoint("llama-gqa", tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 23, 40)]
    kwargs = dict(token_budget=16, kv_cache_memory="8MiB", device="cpu", dtype="float32", progress=False)
    outs = {}
    for size in (1, 2):
        with fuseserve.pipeline(str(tmp_path), tensor_parallel_size=size, **kwargs) as pipe:
            outs[size] = [r.token_ids for r in pipe(prompts, max_new_tokens=10, temperature=0.0)]
            if size == 2:
                assert len(pipe.runner.followers) == 1 and pipe.runner.followers[0].is_alive()
    assert all(len(t) == 10 for t in outs[1]), "guard: generation must not stop at once"
    assert outs[2] == outs[1]


def test_pipeline_refuses_a_bad_tensor_parallel_size(tmp_path):
    import fuseserve
    from fuseserve.errors import InvalidParameterError

    tiny_checkpoint("llama-gqa", tmp_path)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        fuseserve.pipeline(str(tmp_path), tensor_parallel_size=0, device="cpu", progress=False)


def test_pipeline_survives_a_lost_rank(tmp_path):
    """In process a lost rank fails the requests with an error; it does not end the caller's process
    (a worker exits instead, so the scheduler moves its sequences)."""
    import fuseserve
    from fuseserve.errors import FuseServeError

    tiny_checkpoint("llama-gqa", tmp_path)
    kwargs = dict(token_budget=16, kv_cache_memory="8MiB", device="cpu", dtype="float32", progress=False)
    with fuseserve.pipeline(str(tmp_path), tensor_parallel_size=2, **kwargs) as pipe:
        assert len(pipe([[5, 6, 7]], max_new_tokens=2, temperature=0.0)[0].token_ids) == 2
        follower = pipe.runner.followers[0]
        follower.kill()
        follower.join(30)
        with pytest.raises(FuseServeError):
            pipe([[5, 6, 7]], max_new_tokens=4, temperature=0.0)
        assert pipe.runner.lost is not None
