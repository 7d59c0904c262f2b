"""CUDA graphs' buckets and static buffers (``services/worker/cuda_graphs.py``), checked on CPU.

Capturing needs a GPU (``benchmarks/gpu_check.sh``, step ``graphs``); what can be wrong without one is
the bookkeeping: the bucket a pass runs in, its padding, and the attention metadata refilled in the
static buffers. Here the "capture" records nothing: replay runs the same forward again over the
static buffers, with the Triton backend (interpreted), so each pass's hidden states must equal the
eager forward's on the same batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

import torch  # noqa: E402
from engine_driver import _chunk, with_blocks  # noqa: E402

from fuseserve.kernels.triton_attention import query_blocks  # noqa: E402
from fuseserve.types import StepPlan  # noqa: E402
from fuseserve.worker.cuda_graphs import CudaGraphs, build_cuda_graphs, decode_sizes, mixed_sizes  # noqa: E402


def test_bucket_sizes():
    assert decode_sizes(1) == [1]
    assert decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_sizes(256)[-1] == 256
    assert mixed_sizes(16) == [16]
    assert mixed_sizes(100) == [16, 32, 64, 100]
    assert mixed_sizes(256) == [16, 32, 64, 128, 256]


@pytest.mark.parametrize("block_q", [1, 3, 8])
def test_query_blocks_cut_each_chunk(block_q):
    lens = [1, 7, 0, 8, 9, 1]
    want_seq, want_start = [], []
    for i, n in enumerate(lens):
        for s in range(0, n, block_q):
            want_seq.append(i)
            want_start.append(s)
    seq, start = query_blocks(lens, block_q)
    assert seq.tolist() == want_seq and start.tolist() == want_start


def tiny_runner(path):
    from tiny_models import llama_config, write_checkpoint

    from fuseserve.config import EngineConfig
    from fuseserve.worker.model_runner import ModelRunner

    cfg = llama_config(hidden_size=64, max_position_embeddings=256)  # 4 heads of 16 over 2 KV heads
    if not (path / "config.json").exists():
        write_checkpoint(cfg, path)
    engine = EngineConfig(device="cpu", dtype="float32", attention_backend="triton", kv_cache_memory="4MiB")
    return ModelRunner(path, cfg, [0], engine, progress=False)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return tiny_runner(tmp_path_factory.mktemp("graphs"))


def replaying(runner, max_tokens: int, max_seqs: int) -> CudaGraphs:
    """Graphs over ``runner`` whose "capture" records nothing: replay runs the forward again."""
    args = runner.model.args
    return CudaGraphs(
        lambda ids, pos: runner.model(ids, pos),
        runner.backend,
        runner.kv_cache,
        (args.num_heads, args.head_dim),
        max_tokens=max_tokens,
        max_seqs=max_seqs,
        max_context=args.max_position_embeddings,
        capture=lambda fn: (fn(), fn)[1],
    )


def test_no_graphs_on_cpu(runner):
    assert runner.graphs is None
    assert build_cuda_graphs(runner, progress=False) is None


def test_replayed_passes_give_the_eager_logits(tmp_path):
    """The same passes on two runners of the same weights: one eager, one replaying its buckets; the
    logits of every token must agree (a padding row written to the cache, a stale query block or
    sequence slot would show in this pass or a later one)."""
    eager, replay = tiny_runner(tmp_path), tiny_runner(tmp_path)
    replay.graphs = replaying(replay, max_tokens=32, max_seqs=8)
    g = torch.Generator().manual_seed(0)
    tokens = {sid: torch.randint(3, 128, (40,), generator=g).tolist() for sid in range(1, 7)}
    prompt = {1: 20, 2: 7, 3: 3, 4: 2, 5: 2, 6: 2}
    pos = dict.fromkeys(tokens, 0)

    def chunks(*sizes):
        out = []
        for sid, n in sizes:
            out.append(_chunk(sid, tokens[sid][: pos[sid] + n], pos[sid], n, prompt[sid]))
            pos[sid] += n
        return out

    every = [(sid, 1) for sid in range(1, 7)]
    passes = [  # (chunks, the bucket the pass must run in: tokens, decode)
        (chunks((1, 20), (2, 7)), (32, False)),  # two prompts: 27 tokens
        (chunks((1, 1), (2, 1), (3, 3)), (16, False)),  # decodes beside a prompt
        (chunks((1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)), (16, False)),
        (chunks(*every), (8, True)),  # 6 decodes: bucket 8, two padding rows
        (chunks((1, 1), (2, 1), (3, 1)), (4, True)),  # after 6 sequences: slots 3.. are stale
        (chunks((2, 1)), (1, True)),
        (chunks((1, 1), (3, 1)), (2, True)),
        (chunks(*every), (8, True)),
    ]
    ran = []  # (bucket, tokens) of each replayed pass
    bucket_for = replay.graphs.bucket_for
    replay.graphs.bucket_for = lambda batch: ran.append((bucket_for(batch), batch.num_tokens)) or ran[-1][0]
    prepared = count_prepares(replay)
    for step, (plan_chunks, bucket) in enumerate(passes):
        want, _ = eager.run_pass(with_blocks(eager, StepPlan(step, list(plan_chunks))), all_logits=True)
        before = len(prepared)
        got, _ = replay.run_pass(with_blocks(replay, StepPlan(step, list(plan_chunks))), all_logits=True)
        assert len(prepared) == before  # a replayed pass builds no eager attention plan
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        b, n = ran[-1]
        assert len(ran) == step + 1 and (b.tokens, b.decode) == bucket
        assert (replay.graphs.slot_mapping[n : b.tokens] == -1).all()


def count_prepares(runner) -> list:
    """Calls of ``runner.backend.prepare`` from now on (one entry each)."""
    calls, prepare = [], runner.backend.prepare
    runner.backend.prepare = lambda *a, **k: calls.append(1) or prepare(*a, **k)
    return calls


def test_a_pass_beyond_the_buckets_prepares_its_plan(tmp_path):
    """No bucket holds a 20-token pass when the graphs stop at 16: it runs eagerly, with the plan built."""
    eager, replay = tiny_runner(tmp_path), tiny_runner(tmp_path)
    replay.graphs = replaying(replay, max_tokens=16, max_seqs=2)
    prepared = count_prepares(replay)
    prompt = list(range(3, 23))
    want, _ = eager.run_pass(with_blocks(eager, StepPlan(0, [_chunk(1, prompt, 0, 20, 20)])), all_logits=True)
    got, _ = replay.run_pass(
        with_blocks(replay, StepPlan(0, [_chunk(1, prompt, 0, 20, 20)])), all_logits=True
    )
    assert len(prepared) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_passes_no_bucket_holds_run_eagerly(runner):
    graphs = replaying(runner, max_tokens=16, max_seqs=2)
    plan = with_blocks(runner, StepPlan(0, [_chunk(7, list(range(3, 23)), 0, 20, 20)]))
    with torch.inference_mode():
        batch, _ = runner.prepare(plan)
    assert graphs.bucket_for(batch) is None and graphs.run(batch) is None  # 20 tokens > 16
    runner.free([7])
