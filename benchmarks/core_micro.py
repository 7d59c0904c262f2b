"""The engine core's own CPU per worker-step, offline: no Redis, no gRPC, no model.

An ``EngineCore`` drives ``--workers`` in-process fake workers whose plans complete when the driver
says so (``_InstantWorker.send`` keeps the plan and its callback; the driver calls back between
polls, as the gRPC client does when an answer arrives), so each ``poll`` applies one result per
worker and plans each worker's next pass.
Measured: the polling thread's CPU (``time.thread_time``) per worker-step, p50 / p99, which covers
``Scheduler.postprocess`` + ``Scheduler.schedule_workers`` + the core's bookkeeping; building the
fake results is outside the measured span.

Workloads (``--workload``):

- ``decode``: every worker holds ``--seqs`` sequences decoding long outputs (8-seq decode passes);
- ``mixed``: sequences finish after ``--new-tokens`` and are replaced by new ``--prompt-len``
  prompts, so passes mix decodes with SplitFuse prefill chunks and admissions.

``python -m benchmarks.core_micro [--workload decode|mixed] [--steps 3000]``

Before/after side by side: ``--compare DIR`` runs this same script alternately against the
scheduler code of the tree at ``DIR`` (e.g. ``git archive main | tar -x -C /tmp/base``) and this
tree, ``--rounds`` times each, in fresh processes, and prints both columns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit


def _use_tree(tree: str) -> None:
    """Import ``fuseserve`` core modules and ``fuseserve.scheduler`` from ``tree`` instead (A/B runs)."""
    import fuseserve
    import fuseserve.scheduler as sched_pkg

    fuseserve.__path__.insert(0, os.path.join(tree, "fuseserve"))
    sched_pkg.__path__[:] = [os.path.join(tree, "services", "scheduler")]


class _InstantWorker:
    """A worker handle whose plans finish when ``complete_oldest`` is called (no model, no thread):
    ``send(plan, on_result)`` as the gRPC client's, which calls back when the answer arrives."""

    def __init__(self):
        self.pending: list[tuple[object, object]] = []

    def send(self, plan, on_result) -> None:
        self.pending.append((plan, on_result))

    def complete_oldest(self) -> bool:
        from fuseserve.types import SampledToken, StepResult

        if not self.pending:
            return False
        plan, on_result = self.pending.pop(0)
        tokens = [
            SampledToken(c.seq_id, 1 + (c.seq_id * 7919 + c.start_pos) % 30000)
            for c in plan.chunks
            if c.sample
        ]
        on_result(plan.step_id, StepResult(plan.step_id, tokens, forward_seconds=0.01, idle_seconds=0.0))
        return True


def run(args) -> dict:
    if args.tree:
        _use_tree(args.tree)
    from fuseserve.config import EngineConfig
    from fuseserve.sampling_params import SamplingParams
    from fuseserve.scheduler.engine_core import EngineCore
    from fuseserve.scheduler.sequence import Sequence

    if args.metrics:
        from fuseserve.scheduler.service.scheduler_metrics import SchedulerMetrics

    config = EngineConfig(token_budget=args.budget, overlap=True)
    core = EngineCore(config, eos_token_ids=[0])
    if args.metrics:
        metrics = SchedulerMetrics(None)
        metrics.watch(core)
        metrics.set_model("bench")
    workers = {}
    for i in range(args.workers):
        workers[f"w{i}"] = _InstantWorker()
        core.add_worker(
            f"w{i}", workers[f"w{i}"], num_blocks=args.blocks, block_size=16, max_model_len=1 << 20
        )
    next_id = 0

    def add(prompt_len: int, new_tokens: int) -> None:
        nonlocal next_id
        prompt = [1 + (next_id * 31 + j) % 30000 for j in range(prompt_len)]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        core.add_request(Sequence(next_id, prompt, params))
        next_id += 1

    total = args.workers * args.seqs
    decode = args.workload == "decode"
    for _ in range(total):
        add(args.prompt_len if not decode else 32, 16_000 if decode else args.new_tokens)
    cpu: list[float] = []
    polls = 0
    failed = 0  # sequences failed by the core (a plan the fake worker could not take): the run is void
    while len(cpu) < args.steps + args.warmup:
        for w in workers.values():
            w.complete_oldest()
        t0 = time.thread_time()
        events = core.poll(timeout=0, record_cpu=False)
        dt = time.thread_time() - t0
        n = core.num_completions
        failed += sum(1 for e in events if e.error is not None)
        if failed and not core.has_work:
            break  # every sequence failed: nothing left to measure
        polls += 1
        if n and polls > 2:
            cpu.append(dt / n)
        if not decode:
            finished = sum(1 for e in events if e.finish_reason is not None)
            for _ in range(finished):
                add(args.prompt_len, args.new_tokens)
    cpu = sorted(cpu[args.warmup :])
    speed = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000
    return {
        "workload": args.workload,
        "workers": args.workers,
        "seqs": args.seqs,
        "tree": args.tree or "here",
        "p50_ms": statistics.median(cpu) * 1e3,
        "p99_ms": cpu[int(0.99 * (len(cpu) - 1))] * 1e3,
        "mean_ms": statistics.fmean(cpu) * 1e3,
        "machine_us": speed * 1e6,  # ``sum(range(1000))``: the machine's speed at the time (load)
        "failed_sequences": failed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("decode", "mixed"), default="decode")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seqs", type=int, default=8, help="sequences per worker")
    p.add_argument("--steps", type=int, default=3000, help="polls measured (each applies --workers steps)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--budget", type=int, default=512, help="token budget per pass")
    p.add_argument("--blocks", type=int, default=16384, help="KV blocks per worker")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--metrics", action="store_true", help="with the Prometheus observers attached")
    p.add_argument("--tree", default=None, help="import the scheduler code from this tree instead")
    p.add_argument("--compare", default=None, help="tree to compare against, side by side (A/B/A/B)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the run, print the top entries")
    args = p.parse_args()
    if args.compare:
        base = [a for a in sys.argv[1:] if a not in ("--compare", args.compare)]
        cols: dict[str, list[tuple[float, float]]] = {"base": [], "here": []}
        for _ in range(args.rounds):
            for label, extra in (("base", ["--tree", args.compare]), ("here", [])):
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.core_micro", *base, *extra],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                row = json.loads(out.strip().splitlines()[-1])
                cols[label].append((row["p50_ms"], row["machine_us"]))
        for label, xs in cols.items():
            runs = " ".join(f"{p50:.4f} ({us:.0f} us)" for p50, us in xs)
            print(f"{label}: p50 ms/worker-step (machine sum(range(1000))) {runs}")
        return
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(run, args)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    else:
        result = run(args)
    print(json.dumps(result))
    if result["failed_sequences"]:
        raise SystemExit(f"{result['failed_sequences']} sequences failed: the numbers above do not count")


if __name__ == "__main__":
    main()
