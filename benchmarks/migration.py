"""KV migration against recompute, side by side: a worker drained mid-decode under long prompts.

A local stack (``fuseserve.serve``) on SmolLM2 in fp32 with two CPU workers and one scheduler. An
undisturbed run gives each stream's greedy text. Then, per mode, a fresh stack runs the same streams
(``--streams`` prompts of ``--prompt-tokens`` random token ids, ``--max-tokens`` greedy tokens each) and
SIGTERMs worker-0 once every stream has decoded a few tokens:

- ``migration=drain``: worker-0's decoding sequences move to worker-1 with their K/V;
- ``migration=off`` with ``--drain-timeout 0.5``: worker-0 hands its sequences back at once and they
  recompute on worker-1 from their prompts (the recompute path).

Reported per mode: texts equal to the undisturbed run's, computed tokens given up (recomputed),
sequences and bytes migrated, transfer seconds and MB/s, worker-0's exit time after SIGTERM, and the
inter-token gaps (p99, max) of the streams after the signal.

``python -m benchmarks.migration [--streams 8] [--prompt-tokens 2000] [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from fuseserve.redis_launcher import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stack_harness import (  # noqa: E402
    MODEL,
    ask_streamed,
    openai_client,
    stats_of_live_schedulers,
    wait_for,
    worker_num_running,
)


def run(url: str, prompts: list[list[int]], max_tokens: int, disturb=None) -> tuple[list, list[list[float]]]:
    """Run the streams; ``disturb()`` once each has 4 chunks. Returns texts and per-stream chunk times."""
    client = openai_client(url, max_retries=0)
    stamps: list[list[float]] = [[] for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(ask_streamed, client, p, max_tokens, stamps[i]) for i, p in enumerate(prompts)]
        if disturb is not None:
            wait_for(lambda: all(len(s) >= 4 for s in stamps), 600, "every stream decoding")
            disturb()
        texts = [f.result(timeout=900) for f in futures]
    return texts, stamps


def disturbed(server, prompts, max_tokens) -> dict:
    """SIGTERM worker-0 mid-decode; the numbers of the run."""
    info: dict = {}

    def sigterm():
        wait_for(lambda: worker_num_running(server.stack, "worker-0"), 60, "worker-0 holding sequences")
        worker = next(p for n, p in server.stack.procs if n == "worker-0")
        info["t0"] = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
        info["exit_s"] = time.monotonic() - info["t0"]

    time.sleep(2.0)  # the scheduler writes its stats record every second: read one made after the last run
    before = wait_for(lambda: stats_of_live_schedulers(server.stack), 30, "the scheduler's stats")[0]
    texts, stamps = run(server.url, prompts, max_tokens, sigterm)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b >= info["t0"]]
    time.sleep(2.0)
    stats = wait_for(lambda: stats_of_live_schedulers(server.stack), 30, "the scheduler's stats")[0]
    return {
        "texts": texts,
        "exit_s": info["exit_s"],
        "itl_p99_s": float(np.percentile(gaps, 99)),
        "itl_max_s": max(gaps),
        # the scheduler's totals less those of the runs before this one
        **{
            k: stats.get(k, 0) - before.get(k, 0)
            for k in ("recomputed_tokens", "migrated", "migrated_bytes", "migration_seconds")
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--log-level", default="WARNING", help="the stack's (INFO: each migration's log)")
    args = p.parse_args(argv)
    import fuseserve

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    kv = f"{(args.streams * (args.prompt_tokens + args.max_tokens) * 46_080 * 3 // 2) >> 20}MiB"  # all fit one worker
    common = dict(
        log_level=args.log_level,
        workers=2,
        dtype="float32",
        device="cpu",
        token_budget=256,
        kv_cache_memory=kv,
    )
    baseline, results = None, {}
    for mode in ("drain", "off"):
        drain = 30.0 if mode == "drain" else 0.5
        with fuseserve.serve(
            MODEL, port=free_port(), migration=mode, drain_timeout=drain, **common
        ) as server:
            if baseline is None:
                t = time.monotonic()
                baseline, _ = run(server.url, prompts, args.max_tokens)
                print(f"undisturbed run: {time.monotonic() - t:.1f} s", flush=True)
            results[mode] = disturbed(server, prompts, args.max_tokens)
            print(f"{mode}: done", flush=True)
    print(
        f"\n{args.streams} streams, prompts of {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens, SmolLM2 fp32"
    )
    print("| | migration (drain) | recompute (off, drain timeout 0.5 s) |\n|---|---:|---:|")
    rows = [
        ("texts equal to the undisturbed run", lambda r: str(r["texts"] == baseline)),
        ("computed tokens given up (recomputed)", lambda r: f"{r['recomputed_tokens']:,}"),
        ("sequences migrated", lambda r: str(r["migrated"])),
        ("K/V bytes migrated", lambda r: f"{r['migrated_bytes'] / 1e6:.1f} MB"),
        ("transfer seconds (MB/s)", lambda r: _rate(r)),
        ("worker-0 exit after SIGTERM", lambda r: f"{r['exit_s']:.2f} s"),
        (
            "inter-token gap p99 / max after SIGTERM",
            lambda r: f"{r['itl_p99_s']:.2f} / {r['itl_max_s']:.2f} s",
        ),
    ]
    for name, cell in rows:
        print(f"| {name} | {cell(results['drain'])} | {cell(results['off'])} |")
    return 0


def _rate(r: dict) -> str:
    s = r["migration_seconds"]
    return f"{s:.2f} s ({r['migrated_bytes'] / 1e6 / s:.0f} MB/s)" if s else "-"


if __name__ == "__main__":
    raise SystemExit(main())
