"""Simulated workers: the same plan and block bookkeeping as the model runner, a latency model instead
of a model, served by the real gRPC worker (``fuseserve worker --simulate PRESET``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import redis
from engine_driver import with_blocks

from fuseserve import messages
from fuseserve.errors import InvalidBlockError, InvalidParameterError, SchedulerError
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.latency_model import PRESETS, get_preset
from fuseserve.worker.sim_runner import (
    SIM_FIRST_TOKEN,
    SIM_VOCAB_SIZE,
    SimulatedRunner,
    prompt_key,
    sim_token,
)

A100 = PRESETS["a100-llama2-7b"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)


def first(seq_id: int, tokens: list[int], sample: bool, prompt_len: int | None = None) -> SeqChunk:
    n = len(tokens)
    return SeqChunk(seq_id, 0, n, tokens, sample, GREEDY, prompt_len or n)


def chunk(seq_id: int, start: int, tokens: list[int], sample: bool) -> SeqChunk:
    return SeqChunk(seq_id, start, len(tokens), tokens, sample)


def decode(seq_id: int, start: int) -> SeqChunk:
    return SeqChunk(seq_id, start, 1, [], True)


@pytest.fixture(scope="module")
def real_runner(tmp_path_factory):
    """A real ``ModelRunner`` on a tiny random LLaMA with a KV cache of 12 blocks of 4 tokens."""
    import torch
    from tiny_runner import tiny_llama_runner

    from fuseserve.worker.kv_cache import bytes_per_block

    memory = 12 * bytes_per_block(1, 4, 2, 16, torch.float32)
    runner = tiny_llama_runner(tmp_path_factory.mktemp("tiny-llama"), block_size=4, kv_cache_memory=memory)
    assert runner.info.num_blocks == 12
    return runner


def twins(real_runner) -> tuple[object, SimulatedRunner]:
    real_runner.free(list(real_runner.seqs))
    sim = SimulatedRunner(A100, block_size=4, num_blocks=12, sleep=lambda s: None)
    return real_runner, sim


def same_state(real, sim) -> None:
    assert sim.num_free_blocks == real.num_free_blocks
    blocks = {sid: s.block_table for sid, s in real.seqs.items()}
    assert {sid: s.block_table for sid, s in sim.seqs.items()} == blocks
    assert {k: v.num_computed for k, v in sim.seqs.items()} == {
        k: v.num_computed for k, v in real.seqs.items()
    }


def test_sim_token_is_a_pure_function_in_range():
    keys = [prompt_key([k, 1, 2]) for k in range(50)]
    toks = [sim_token(k, p) for k in keys for p in range(50)]
    assert toks == [sim_token(k, p) for k in keys for p in range(50)]
    assert all(SIM_FIRST_TOKEN <= t < SIM_VOCAB_SIZE for t in toks)
    assert len(set(toks)) > 2000  # spread, not a constant
    assert prompt_key([4, 5], prompt_key([1, 2, 3])) == prompt_key([1, 2, 3, 4, 5])  # chunks compose


def test_accounts_blocks_exactly_like_the_model_runner(real_runner):
    real, sim = twins(real_runner)
    plans = [
        StepPlan(0, [first(1, list(range(1, 10)), False, prompt_len=14), first(2, [5, 6, 7], True)]),
        StepPlan(1, [chunk(1, 9, [1, 2, 3, 4, 5], True), decode(2, 3)]),
        StepPlan(2, [decode(1, 14), decode(2, 4), first(3, list(range(20, 37)), True)]),
        StepPlan(3, [decode(1, 15), decode(3, 17)], free_seq_ids=[2]),
        StepPlan(4, [first(1, list(range(1, 6)), True)], free_seq_ids=[3]),  # recompute from scratch
    ]
    for plan in plans:
        with_blocks(real, plan)  # both runners get the same block ids, as from one scheduler
        r_real, r_sim = real.step(plan), sim.step(plan)
        assert [t.seq_id for t in r_sim.tokens] == [t.seq_id for t in r_real.tokens]
        same_state(real, sim)
    sim.free(list(sim.seqs))
    assert sim.num_free_blocks == sim.info.num_blocks


BAD_PLANS = {
    "unknown sequence": (StepPlan(1, [chunk(9, 3, [1], True)]), SchedulerError),
    "wrong start_pos": (StepPlan(1, [chunk(1, 2, [1], True)]), SchedulerError),
    "decode before a sample": (StepPlan(1, [decode(1, 5)]), SchedulerError),
    "token count": (StepPlan(1, [SeqChunk(1, 5, 2, [1], True)]), SchedulerError),
    "no blocks for the chunk": (StepPlan(1, [first(4, list(range(1, 50)), True)]), SchedulerError),
    "block id outside the pool": (
        StepPlan(1, [SeqChunk(4, 0, 2, [1, 2], True, GREEDY, 2, block_ids=[12])]),
        InvalidBlockError,
    ),
}


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_rejects_what_the_model_runner_rejects(real_runner, name):
    real, sim = twins(real_runner)
    setup = with_blocks(real, StepPlan(0, [first(1, [1, 2, 3, 4, 5], False, prompt_len=9)]))
    real.step(setup), sim.step(setup)
    plan, error = BAD_PLANS[name]
    with pytest.raises(error):
        real.step(plan)
    with pytest.raises(error):
        sim.step(plan)
    same_state(real, sim)


def test_sleeps_the_modelled_time_and_tokens_ignore_batching():
    slept = []
    sim = SimulatedRunner(A100, slowdown=3.0, sleep=slept.append)
    one = with_blocks(sim, StepPlan(0, [first(7, list(range(30)), True)]))
    res = sim.step(one)
    assert slept == [pytest.approx(3.0 * A100.plan_seconds(one))]
    assert (
        sim.step(with_blocks(sim, StepPlan(1, []))).tokens == [] and len(slept) == 1
    )  # an empty plan takes no time
    # the same prompt in two chunks, under another sequence id, next to another sequence: same tokens
    other = SimulatedRunner(A100, sleep=lambda s: None)
    other.step(
        with_blocks(
            other, StepPlan(0, [first(5, list(range(12)), False, prompt_len=30), first(8, [1, 2], True)])
        )
    )
    res2 = other.step(with_blocks(other, StepPlan(1, [chunk(5, 12, list(range(12, 30)), True)])))
    key = prompt_key(list(range(30)))
    assert res.tokens[0].token_id == res2.tokens[0].token_id == sim_token(key, 30)
    assert sim.step(with_blocks(sim, StepPlan(2, [decode(7, 30)]))).tokens[0].token_id == sim_token(key, 31)
    # a prefix-cache hit: the first chunk starts at 16 and carries the cached tokens' ids: same token
    hit = SeqChunk(9, 16, 14, list(range(16, 30)), True, GREEDY, 30, prefix_token_ids=list(range(16)))
    assert other.step(with_blocks(other, StepPlan(2, [hit]))).tokens[0].token_id == sim_token(key, 30)
    # a recompute resends prompt + generated tokens: the prompt key and the next token are unchanged
    redo = StepPlan(3, [first(7, [*range(30), sim_token(key, 30), sim_token(key, 31)], True, prompt_len=30)])
    assert sim.step(with_blocks(sim, redo)).tokens[0].token_id == sim_token(key, 32)
    assert sim.info.eos_token_ids == []  # never ends a sequence by EOS


def test_presets_and_errors():
    assert {"a100-llama2-7b", "a6000-llama2-7b", "cpu-smollm2"} <= set(PRESETS)
    with pytest.raises(InvalidParameterError):
        get_preset("h100-imaginary")
    with pytest.raises(ValueError):
        SimulatedRunner(A100, slowdown=0)
    cpu = PRESETS["cpu-smollm2"]
    assert cpu.max_model_len == 8192 and cpu.latency(1) < cpu.latency(256)


def test_simulated_worker_process_registers_serves_and_exports_metrics():
    from fuseserve.redis_launcher import launch_redis
    from fuseserve.scheduler.service.grpc_worker import GrpcWorker

    with launch_redis() as rs:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "fuseserve.cli", "worker", "--redis-url", rs.url, "--port", "0"]
        cmd += ["--metrics-port", "0", "--worker-id", "sim-0", "--simulate", "a100-llama2-7b"]
        cmd += ["--drain-timeout", "0"]  # it keeps sequences no scheduler frees: SIGTERM stops at once
        proc = subprocess.Popen(cmd + ["--simulate-slowdown", "2"])
        try:
            r = redis.Redis.from_url(rs.url)
            raw = None
            while raw is None and time.monotonic() - t0 < 60:
                assert proc.poll() is None, "the simulated worker exited"
                raw = r.get(messages.worker_key("sim-0"))
                time.sleep(0.05)
            started = time.monotonic() - t0
            rec = messages.WorkerRecord.decode(raw)
            assert rec.num_blocks == A100.kv_capacity_tokens // 16 and rec.eos_token_ids == []
            assert rec.token_budget == A100.knee() and rec.metrics_port
            maps = open(f"/proc/{proc.pid}/maps").read()
            assert "libtorch" not in maps, f"torch loaded (registered after {started:.1f} s)"
            handle = GrpcWorker(rec)
            plan = StepPlan(3, [first(1, list(range(100, 164)), True), first(2, [5, 6], True)])
            assign_block_ids(BlockAccount(rec.num_blocks, 16, False), plan)
            res = handle.step(plan)
            keys = [prompt_key(list(range(100, 164))), prompt_key([5, 6])]
            assert [t.token_id for t in res.tokens] == [sim_token(keys[0], 64), sim_token(keys[1], 2)]
            assert res.forward_seconds >= 2 * A100.plan_seconds(plan)
            with pytest.raises(Exception, match="SchedulerError"):
                handle.step(StepPlan(4, [chunk(1, 7, [1], True)]))
            handle.close()
            text = httpx.get(f"http://127.0.0.1:{rec.metrics_port}/metrics").text
            labels = 'model_name="smollm2-135m-instruct",worker="sim-0"'
            pass_labels = 'model_name="smollm2-135m-instruct",pass_size="65-256",worker="sim-0"'
            assert f"fuseserve_forward_time_seconds_count{{{pass_labels}}} 1.0" in text
            assert f"fuseserve_sampled_tokens_total{{{labels}}} 2.0" in text
            assert f"fuseserve_kv_cache_blocks_total{{{labels}}} {float(rec.num_blocks)}" in text
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_serve_builds_simulated_worker_command_lines():
    from fuseserve.cli import serve_args
    from fuseserve.launcher import slowdown_of, worker_argv

    args = serve_args(workers=3, simulate="cpu-smollm2", simulate_slowdown="1,3")
    lines = [worker_argv(args, "redis://x", i) for i in range(3)]
    assert [line[line.index("--simulate-slowdown") + 1] for line in lines] == ["1.0", "3.0", "1.0"]
    assert all("--simulate" in line and "--threads" not in line for line in lines)
    assert all(line[line.index("--metrics-port") + 1] == "0" for line in lines)
    real = worker_argv(serve_args(workers=2), "redis://x", 0)
    assert "--simulate" not in real and real[real.index("--threads") + 1] == str(
        max(1, len(os.sched_getaffinity(0)) // 2)
    )
    for bad in ("0", "x", "1,-2"):
        with pytest.raises(InvalidParameterError):
            slowdown_of(serve_args(simulate_slowdown=bad), 1)


def test_scale_out_report_and_plot(tmp_path):
    from benchmarks.plots import plot_scale_out
    from benchmarks.scale_out import efficiency, report

    def rec(label, n, tps, slowdowns=None, tokens=None):
        busy = [0.9] * n
        cores = {"scheduler": 0.1, "gateway": 0.1, "redis": 0.0, "workers": 0.1, "client": 0.0}
        return {
            "label": label,
            "workers": n,
            "clients": 8 * n,
            "gen_tokens_per_s": tps,
            "client_tokens_per_s": tps,
            "busy_min": 0.9,
            "busy_mean": 0.9,
            "worker_busy": busy,
            "worker_tokens": tokens or [1.0] * n,
            "slowdowns": slowdowns or [1.0] * n,
            "sched_cpu_ms_per_step_p50": 0.5,
            "sched_cpu_ms_per_step_p99": 0.9,
            "sched_cpu_ms_per_step_mean": 0.6,
            "cpu_cores": cores,
            "mean_latency_s": 2.0,
        }

    records = [
        rec("scale", 1, 100.0),
        rec("scale", 4, 360.0),
        rec("hetero", 2, 50.0, [1.0, 3.0], [300.0, 100.0]),
    ]
    efficiency(records)
    assert records[1]["efficiency"] == pytest.approx(0.9) and "efficiency" not in records[2]
    lines = report(records)
    assert records[2]["fast_slow_token_ratio"] == pytest.approx(3.0)
    assert records[2]["slow_token_share"] == pytest.approx(0.25)
    assert "tokens fast/slow = 3.00, slow share 0.250; mean latency 2.00 s" in lines[-2]
    assert records[2]["vs_fast_alone"] == pytest.approx(0.5) and "x0.50" in lines[-1]  # 50 vs 100 tok/s
    assert plot_scale_out(records, tmp_path / "s.png").stat().st_size > 1000
