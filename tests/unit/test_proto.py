"""The scheduler ↔ worker gRPC contract: stubs, reproducible generation, conversions, a live server."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
from sampling_cases import full_params

from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SampledToken, SeqChunk, StepPlan, StepResult, TokenLogprob

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
GENERATED = ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi")


def test_stubs_import_from_package():
    assert pb.DESCRIPTOR.package == "fuseserve.worker.v1"
    assert pb.DESCRIPTOR.services_by_name["Worker"].full_name == "fuseserve.worker.v1.Worker"
    assert pb_grpc.worker__pb2 is pb  # the grpc stub imports the pb2 module through the package
    assert set(pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name) == {
        "Info",
        "Step",
        "Steps",
        "Free",
        "Migrate",
        "ImportSeqs",
        "Health",
    }


def test_every_proto_field_is_commented():
    lines = (PROTO_DIR / "worker.proto").read_text().splitlines()
    num_fields = 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "//")):
            num_fields += 1
            assert lines[i - 1].strip().startswith("//"), f"uncommented field at line {i + 1}: {stripped}"
    assert num_fields > 20, f"only {num_fields} fields found in worker.proto: the check read the wrong lines"


def test_generate_sh_is_reproducible(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(PROTO_DIR / "generate.sh"), str(tmp_path)], check=True, env=env)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (PROTO_DIR / name).read_bytes(), (
            f"{name} is stale: run proto/generate.sh"
        )


def test_sampling_params_round_trip():
    params = full_params()
    assert convert.sampling_params_from_proto(convert.sampling_params_to_proto(params)) == params
    defaults = SamplingParams()  # seed / logprobs None must stay None, not become 0
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(defaults))
    assert back == defaults and back.seed is None and back.logprobs is None
    zero = SamplingParams(logprobs=0, seed=0)  # 0 is "chosen token only", distinct from None
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(zero))
    assert back.logprobs == 0 and back.seed == 0


def _plan() -> StepPlan:
    return StepPlan(
        step_id=2**40 + 7,
        chunks=[
            SeqChunk(seq_id=1, start_pos=0, num_tokens=4, token_ids=[10, 11, 12, 13], sample=False,
                     params=full_params(), prompt_len=9, lora="team-a"),
            SeqChunk(seq_id=2**63 + 5, start_pos=37, num_tokens=1),  # decode entry: no token ids
            SeqChunk(seq_id=3, start_pos=4, num_tokens=5, token_ids=[1, 2, 3, 4, 5], sample=True),
        ],
        free_seq_ids=[9, 2**64 - 1],
    )  # fmt: skip


def _result() -> StepResult:
    return StepResult(
        step_id=2**40 + 7,
        tokens=[
            SampledToken(seq_id=2**63 + 5, token_id=42),
            SampledToken(
                seq_id=3,
                token_id=7,
                logprob=-0.123456789,
                top_logprobs=[TokenLogprob(7, -0.123456789), TokenLogprob(8, -2.5)],
            ),
            SampledToken(seq_id=4, token_id=0, logprob=0.0),
        ],
        forward_seconds=0.0421,
    )


def test_step_plan_round_trip():
    plan = _plan()
    msg = convert.step_plan_to_proto(plan)
    assert not msg.chunks[1].HasField("params") and msg.chunks[0].HasField("params")
    wire = pb.StepRequest.FromString(msg.SerializeToString())
    assert convert.step_plan_from_proto(wire) == plan


def test_step_result_round_trip():
    result = _result()
    msg = convert.step_result_to_proto(result, num_free_blocks=123)
    wire = pb.StepResponse.FromString(msg.SerializeToString())
    assert wire.num_free_blocks == 123
    back = convert.step_result_from_proto(wire)
    assert back == result
    assert back.tokens[0].logprob is None and back.tokens[2].logprob == 0.0


class _DummyWorker(pb_grpc.WorkerServicer):
    """Samples token ``seq_id + start_pos + num_tokens`` for each sampling chunk."""

    def __init__(self):
        self.freed: list[int] = []

    def Info(self, request, context):
        return pb.WorkerInfo(worker_id="w0", model="dummy", block_size=16, num_blocks=100,
                             max_model_len=2048, vocab_size=49152, eos_token_ids=[2], device="cpu",
                             dtype="float32")  # fmt: skip

    def Step(self, request, context):
        plan = convert.step_plan_from_proto(request)
        self.freed.extend(plan.free_seq_ids)
        tokens = [
            SampledToken(seq_id=c.seq_id, token_id=c.seq_id + c.start_pos + c.num_tokens, logprob=-1.0)
            for c in plan.chunks
            if c.sample
        ]
        result = StepResult(step_id=plan.step_id, tokens=tokens, forward_seconds=0.5)
        return convert.step_result_to_proto(result, num_free_blocks=90)

    def Free(self, request, context):
        self.freed.extend(request.seq_ids)
        return pb.FreeResponse(num_free_blocks=100)

    def Health(self, request, context):
        return pb.HealthResponse(ok=True, num_free_blocks=100, num_running_seqs=0)


def test_grpc_server_answers_step():
    servicer = _DummyWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    assert port != 0
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=10)
            assert (info.worker_id, info.num_blocks, list(info.eos_token_ids)) == ("w0", 100, [2])
            response = stub.Step(convert.step_plan_to_proto(_plan()), timeout=10)
            result = convert.step_result_from_proto(response)
            assert result.step_id == 2**40 + 7
            assert [(t.seq_id, t.token_id) for t in result.tokens] == [(3, 3 + 4 + 5)]
            assert response.num_free_blocks == 90 and result.forward_seconds == 0.5
            assert stub.Free(pb.FreeRequest(seq_ids=[5]), timeout=10).num_free_blocks == 100
            assert stub.Health(pb.HealthRequest(), timeout=10).ok
            assert servicer.freed == [9, 2**64 - 1, 5]
    finally:
        server.stop(grace=None)
