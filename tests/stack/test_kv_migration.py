"""KV migration between two real gRPC workers (``services/worker/kv_migration.py``): a decoding
sequence moved with ``Migrate`` continues on the destination with exactly the tokens it gets when it
stays, greedy and seeded sampling alike, without recomputing its prompt; a stale fence moves nothing.
Real ``ModelRunner``s over one random 2-layer LLaMA, and simulated runners (no K/V)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.latency_model import get_preset
from fuseserve.worker.server import WorkerServicer
from fuseserve.worker.sim_runner import SimulatedRunner

BLOCK = 4
PROMPT = list(range(3, 22))  # 19 tokens: 5 blocks, the last one partly filled
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=64, temperature=1.0, seed=7, ignore_eos=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from lora_checkpoints import write_adapter
    from tiny_models import llama_config, write_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama-2l")
    cfg = llama_config(max_position_embeddings=256)
    hf = write_checkpoint(cfg, path)
    adapter = write_adapter(hf, tmp_path_factory.mktemp("a8") / "a8", 8, ["q_proj", "v_proj", "down_proj"], 2)
    return path, cfg, {"a8": str(adapter)}


class _Worker:
    """A runner behind a real gRPC server, with the scheduler's block account for it."""

    def __init__(self, runner, taken: int = 0):
        self.runner = runner
        self.servicer = WorkerServicer(runner, "w", "m")
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=convert.GRPC_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(f'127.0.0.1:{free_port()}')}"
        self.server.start()
        self.account = BlockAccount(runner.info.num_blocks, BLOCK, prefix_caching=False)
        if taken:  # other sequences hold the first blocks: the moved one lands on other ids
            self.account.reserve(999, taken * BLOCK)
        self.step_id = 0
        self.stub = pb_grpc.WorkerStub(grpc.insecure_channel(self.address))

    def run_chunk(self, chunk: SeqChunk):
        """Run one chunk (its blocks from the account); the ``StepResult``."""
        self.account.reserve(chunk.seq_id, chunk.start_pos + chunk.num_tokens)
        chunk.block_ids = self.account.unsent(chunk.seq_id)
        result = self.runner.step(StepPlan(self.step_id, [chunk]))
        self.step_id += 1
        return result

    def run(self, chunk: SeqChunk) -> int:
        """Run one sampling chunk; the token sampled."""
        return self.run_chunk(chunk).tokens[0].token_id

    def close(self) -> None:
        self.server.stop(grace=None)


def _decode(worker: _Worker, pos: int, n: int) -> list[int]:
    return [worker.run(SeqChunk(1, pos + i, 1, [], True)) for i in range(n)]


def _model_runner(checkpoint, lora: bool = False):
    from fuseserve.config import EngineConfig
    from fuseserve.worker.model_runner import ModelRunner

    path, cfg, adapters = checkpoint
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory="1MiB",
        lora_modules=adapters if lora else None,
    )
    return ModelRunner(path, cfg, [0], config, progress=False)


def _migrate(
    src: _Worker, dst: _Worker, seq_id: int, num_tokens: int, fence: int = 0, shared: list[int] = ()
) -> pb.MigrateResponse:
    dst.account.reserve(seq_id, num_tokens, list(shared))
    ids = dst.account.unsent(seq_id)
    move = pb.SeqMove(seq_id=seq_id, dest_block_ids=ids, num_shared_blocks=len(shared))
    request = pb.MigrateRequest(fence=fence, dest_address=dst.address, dest_fence=fence, moves=[move])
    return src.stub.Migrate(request, timeout=60)


@pytest.mark.parametrize("sampling", sorted(PARAMS))
def test_a_moved_sequence_decodes_on_the_destination_as_it_would_have_at_home(checkpoint, sampling):
    home, src, dst = (_Worker(_model_runner(checkpoint), taken) for taken in (0, 0, 3))
    try:
        first = SeqChunk(1, 0, len(PROMPT), PROMPT, True, PARAMS[sampling], len(PROMPT))
        assert home.run(first) == src.run(SeqChunk(**{**vars(first), "block_ids": []}))
        pos = len(PROMPT)
        assert _decode(home, pos, 3) == _decode(src, pos, 3)
        pos += 3
        answer = _migrate(src, dst, 1, pos)
        assert list(answer.moved_seq_ids) == [1] and not answer.error
        assert 1 not in src.runner.seqs and dst.runner.seqs[1].block_table[0] == 3  # other block ids
        # 2 layers x K,V x 6 blocks x 4 tokens x 2 KV heads x 8 dims x 4 bytes (fp32)
        assert answer.num_bytes == 2 * 2 * 6 * BLOCK * 2 * 8 * 4
        stayed, moved = _decode(home, pos, 12), _decode(dst, pos, 12)
        assert moved == stayed
    finally:
        for w in (home, src, dst):
            w.close()


def test_a_sequence_part_way_through_its_prompt_moves_and_finishes_it_there(checkpoint):
    home, src, dst = (_Worker(_model_runner(checkpoint), taken) for taken in (0, 0, 3))
    try:
        params = PARAMS["greedy"]
        for w in (home, src):  # the first 8 prompt tokens computed, nothing sampled yet
            w.run_chunk(SeqChunk(1, 0, 8, PROMPT[:8], False, params, len(PROMPT)))
        answer = _migrate(src, dst, 1, len(PROMPT))  # blocks for the whole prompt, as the scheduler reserves
        assert list(answer.moved_seq_ids) == [1] and dst.runner.seqs[1].last_token is None
        assert len(dst.runner.seqs[1].block_table) == 5 and answer.num_bytes == 2 * 2 * 2 * BLOCK * 2 * 8 * 4
        rest = lambda w: w.run(SeqChunk(1, 8, len(PROMPT) - 8, PROMPT[8:], True))  # noqa: E731
        assert rest(dst) == rest(home)
        assert _decode(dst, len(PROMPT), 6) == _decode(home, len(PROMPT), 6)
    finally:
        for w in (home, src, dst):
            w.close()


def test_blocks_the_destination_caches_are_shared_not_sent(checkpoint):
    """The destination computed the same prompt for another sequence: the moved one's first 4 blocks
    are those (their K/V not sent), the rest comes over, and it decodes as it would at home."""
    home, src, dst = (_Worker(_model_runner(checkpoint)) for _ in range(3))
    try:
        params = PARAMS["greedy"]
        first = SeqChunk(1, 0, len(PROMPT), PROMPT, True, params, len(PROMPT))
        assert home.run(first) == src.run(SeqChunk(**{**vars(first), "block_ids": []}))
        dst.run(SeqChunk(**{**vars(first), "seq_id": 2, "block_ids": []}))  # the same prompt there
        pos = len(PROMPT)
        assert _decode(home, pos, 3) == _decode(src, pos, 3)
        pos += 3
        cached = dst.account.tables[2][:4]  # the full blocks of the prompt (19 tokens)
        answer = _migrate(src, dst, 1, pos, shared=cached)
        assert list(answer.moved_seq_ids) == [1] and not answer.error
        assert dst.runner.seqs[1].block_table[:4] == cached
        assert answer.num_bytes == 2 * 2 * 2 * BLOCK * 2 * 8 * 4  # 2 of its 6 blocks sent
        assert _decode(dst, pos, 12) == _decode(home, pos, 12)
    finally:
        for w in (home, src, dst):
            w.close()


def test_a_lora_sequence_moves_with_its_adapter_and_only_where_it_is_served(checkpoint):
    home, src, dst = (_Worker(_model_runner(checkpoint, lora=True), taken) for taken in (0, 0, 3))
    plain = _Worker(_model_runner(checkpoint))
    try:
        first = SeqChunk(1, 0, len(PROMPT), PROMPT, True, PARAMS["greedy"], len(PROMPT), lora="a8")
        assert home.run(first) == src.run(SeqChunk(**{**vars(first), "block_ids": []}))
        pos = len(PROMPT)
        refused = _migrate(src, plain, 1, pos)  # a worker without the adapter does not take it
        assert not refused.moved_seq_ids and "a8" in refused.error and 1 in src.runner.seqs
        answer = _migrate(src, dst, 1, pos)
        assert list(answer.moved_seq_ids) == [1] and dst.runner.seqs[1].lora == "a8"
        assert _decode(dst, pos, 8) == _decode(home, pos, 8)  # decodes on under its adapter
    finally:
        for w in (home, src, dst, plain):
            w.close()


def test_a_stale_fence_moves_nothing(checkpoint):
    src, dst = _Worker(_model_runner(checkpoint)), _Worker(_model_runner(checkpoint))
    try:
        src.run(SeqChunk(1, 0, len(PROMPT), PROMPT, True, PARAMS["greedy"], len(PROMPT)))
        src.stub.Free(pb.FreeRequest(fence=2))  # a newer scheduler drives the source
        answer = _migrate(src, dst, 1, len(PROMPT), fence=1)
        assert answer.fenced and not answer.moved_seq_ids
        assert 1 in src.runner.seqs and 1 not in dst.runner.seqs
    finally:
        src.close()
        dst.close()


def test_simulated_workers_move_their_sequences_too():
    preset = get_preset("a100-llama2-7b")
    home, src, dst = (_Worker(SimulatedRunner(preset, BLOCK, 64, slowdown=0.001), t) for t in (0, 0, 2))
    try:
        first = SeqChunk(1, 0, len(PROMPT), PROMPT, True, PARAMS["greedy"], len(PROMPT))
        home.run(first)
        src.run(SeqChunk(**{**vars(first), "block_ids": []}))
        pos = len(PROMPT)
        answer = _migrate(src, dst, 1, pos)
        assert list(answer.moved_seq_ids) == [1] and answer.num_bytes == 0
        assert _decode(dst, pos, 5) == _decode(home, pos, 5)
    finally:
        for w in (home, src, dst):
            w.close()
