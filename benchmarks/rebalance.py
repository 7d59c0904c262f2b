"""Rebalancing by KV migration (``--migration balance``) against none (``off``), side by side.

A real stack (Redis, one scheduler, gateway) with SIMULATED workers (``fuseserve worker --simulate
PRESET``: the gRPC worker with a latency model, its KV moved by the same ``Migrate`` RPC as a real
worker's). The burst lands on a slow worker first: the stack starts with one worker of slowdown
``--slow`` alone; ``--requests`` streamed requests (token-id prompts of ``--prompt-tokens``,
``--max-tokens`` each, EOS ignored) are sent at once; when the slow worker holds ``--join-at`` of them,
a worker of slowdown 1 joins. Without rebalancing the slow worker keeps what it holds and the clients
wait on it; with ``balance`` the scheduler moves sequences, with their K/V, to the fast worker.

Reported per mode: TTFT p50 / p95, end-to-end latency p95, total time (first send to last token),
when the fast worker joined and the time from then to the last token, the sequences moved (a
simulated worker holds no K/V bytes: ``benchmarks/migration.py`` measures the transfer on SmolLM2),
and the sequences admitted per worker (a moved sequence counts on both).

``python -m benchmarks.rebalance [--requests 32] [--preset a100-llama2-7b] [--slow 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import redis

from benchmarks.metrics import percentiles
from benchmarks.peers import openai_send
from benchmarks.workload import BenchRequest, closed_loop
from fuseserve import messages
from fuseserve.cli import serve_args
from fuseserve.launcher import start_stack
from fuseserve.redis_launcher import free_port
from fuseserve.worker.sim_runner import SIM_FIRST_TOKEN, SIM_VOCAB_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stack_harness import spawn_sim_worker  # noqa: E402

MODEL = "smollm2-135m-instruct"  # the gateway's tokenizer


def _stats(r: redis.Redis) -> dict:
    return messages.read_scheduler_stats(r)


def run_mode(args: argparse.Namespace, mode: str, requests: list[BenchRequest]) -> dict:
    """One stack, one burst; the numbers of the run."""
    options = serve_args(
        model=MODEL,
        workers=1,
        port=free_port(),
        simulate=args.preset,
        simulate_slowdown=str(args.slow),
        migration=mode,
        log_level=args.log_level,
    )
    stack, base = start_stack(options)
    try:
        r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
        joined: dict = {}

        async def join_fast() -> None:
            while _stats(r).get("workers", {}).get("worker-0", {}).get("running", 0) < args.join_at:
                await asyncio.sleep(0.05)
            spawn_sim_worker(stack, options, 1, 1.0)
            joined["t"] = time.perf_counter()

        async def burst():
            send = openai_send(f"{base}/v1", MODEL)
            joiner = asyncio.create_task(join_fast())
            result = await closed_loop(requests, send, len(requests))
            joiner.cancel()
            return result

        t0 = time.perf_counter()
        result = asyncio.run(burst())
        time.sleep(1.5)  # the scheduler writes its stats record every second
        stats = _stats(r)
        scheduler = json.loads(next(r.get(k) for k in r.scan_iter(match=f"{messages.SCHEDULER_STATS}:*")))
    finally:
        stack.stop()
    traces = result.traces
    errors = [t.error for t in traces if t.error]
    for error in sorted(set(errors)):
        print(f"{mode}: {errors.count(error)} requests failed: {error}", flush=True)
    last = max(t.token_times[-1] for t in traces if t.token_times)
    return {
        "mode": mode,
        "errors": len(errors),
        "ttft": percentiles([t.ttft for t in traces if t.ok], (50, 95)),
        "e2e_p95": percentiles([t.e2e_latency for t in traces if t.ok], (95,))["p95"],
        "total_s": last - t0,
        "join_s": joined.get("t", float("nan")) - t0,
        "tokens": sum(t.output_tokens for t in traces),
        "moved": scheduler.get("rebalanced", 0),
        "admitted": {w: v["admitted"] for w, v in stats.get("workers", {}).items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--preset", default="a100-llama2-7b")
    p.add_argument("--slow", type=float, default=3.0, help="the first worker's slowdown (the joining one: 1)")
    p.add_argument("--join-at", type=int, default=None, help="sequences the slow worker holds (default: all)")
    p.add_argument("--modes", default="off,balance")
    p.add_argument("--log-level", default="WARNING", help="the stack's (INFO: each move's log line)")
    args = p.parse_args(argv)
    args.join_at = args.join_at or args.requests
    rng = np.random.default_rng(0)
    requests = [
        BenchRequest(
            rng.integers(SIM_FIRST_TOKEN, SIM_VOCAB_SIZE, args.prompt_tokens).tolist(), "", args.max_tokens
        )
        for _ in range(args.requests)
    ]
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(args, mode, requests))
        print(f"{mode}: done", flush=True)
    print(
        f"\n{args.requests} requests at once (prompt {args.prompt_tokens}, output {args.max_tokens}), "
        f"simulated {args.preset}: worker-0 x{args.slow} alone, worker-1 x1 joins when worker-0 holds "
        f"{args.join_at}"
    )
    print("| | " + " | ".join(r["mode"] for r in results) + " |\n|---|" + "---:|" * len(results))
    rows = [
        ("TTFT p50 / p95", lambda r: f"{r['ttft']['p50']:.2f} / {r['ttft']['p95']:.2f} s"),
        ("end-to-end p95", lambda r: f"{r['e2e_p95']:.2f} s"),
        ("total time (first send to last token)", lambda r: f"{r['total_s']:.2f} s"),
        (
            "worker-1 joined after / last token after the join",
            lambda r: f"{r['join_s']:.2f} / {r['total_s'] - r['join_s']:.2f} s",
        ),
        ("sequences moved", lambda r: str(r["moved"])),
        (
            "sequences admitted per worker",
            lambda r: ", ".join(f"{w} {n}" for w, n in sorted(r["admitted"].items())),
        ),
        ("tokens / errors", lambda r: f"{r['tokens']} / {r['errors']}"),
    ]
    for name, cell in rows:
        print(f"| {name} | " + " | ".join(cell(r) for r in results) + " |")
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
