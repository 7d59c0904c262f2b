"""How busy the engine core keeps its workers: fake workers that sleep like a GPU pass.

Each fake worker (``tests/fake_worker.py``'s plan semantics) sleeps ``8 ms + 0.04 ms x tokens`` per
pass (times ``slowdown``), the shape of a GPU forward pass. Closed-loop clients (``--clients`` per
worker) send a new request as soon as one finishes, for ``--seconds``; per worker we report the busy
fraction over that window (seconds in passes / wall seconds) and the tokens it computed, and the
engine core's CPU time per worker-step. Scenarios: one fast and one 3x slower worker, 2 equal
workers, 8 equal workers. Runs on the code before the engine core too (``Scheduler`` +
``EngineLoop``, one barrier per step), for a side-by-side comparison.

``python -m benchmarks.worker_busy [--seconds S] [--clients C] [--no-overlap]``
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fake_worker import EOS, FakeWorker  # noqa: E402

from fuseserve.config import EngineConfig  # noqa: E402
from fuseserve.sampling_params import SamplingParams  # noqa: E402
from fuseserve.scheduler.sequence import Sequence  # noqa: E402
from fuseserve.types import StepPlan, StepResult  # noqa: E402

BASE_S = 0.008  # seconds per pass
PER_TOKEN_S = 0.00004  # seconds per token in the pass


class SleepyWorker(FakeWorker):
    """A fake worker whose pass takes ``slowdown x (8 ms + 0.04 ms/token)`` of wall time.

    passes: ``(start, end, tokens)`` of every pass, perf_counter seconds.
    """

    def __init__(self, *a, slowdown: float = 1.0, **kw):
        super().__init__(*a, **kw)
        self.slowdown = slowdown
        self.passes: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()

    def step(self, plan: StepPlan) -> StepResult:
        with self._lock:  # a worker runs one pass at a time
            t0 = time.perf_counter()
            result = super().step(plan)
            time.sleep(self.slowdown * (BASE_S + PER_TOKEN_S * plan.num_tokens))
            t1 = time.perf_counter()
            result.forward_seconds = t1 - t0
            self.passes.append((t0, t1, plan.num_tokens))
            return result

    def window(self, t0: float, t1: float) -> tuple[float, int]:
        """Seconds in passes within ``[t0, t1]`` and tokens of the passes that ended in it."""
        busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e, _ in self.passes)
        return busy, sum(n for s, e, n in self.passes if t0 <= e <= t1)


def run(slowdowns: list[float], seconds: float, clients: int, overlap: bool, seed: int = 0) -> dict:
    """Closed-loop greedy requests over workers with the given slowdowns for ``seconds``; returns stats."""
    cfg = EngineConfig(token_budget=256, max_num_seqs=64, block_size=16, policy="splitfuse")
    fakes = {
        f"w{i}": SleepyWorker(1 << 16, 16, eos_every=0, name=f"w{i}", slowdown=s, history={})
        for i, s in enumerate(slowdowns)
    }
    rng = random.Random(seed)
    ids = iter(range(1 << 30))

    def request() -> Sequence:
        prompt = [rng.randint(1, 999) for _ in range(rng.randint(50, 300))]
        return Sequence(
            next(ids), prompt, SamplingParams(temperature=0.0, max_new_tokens=rng.randint(20, 80))
        )

    try:
        from fuseserve.scheduler.engine_core import EngineCore
    except ImportError:  # the code before the engine core: Scheduler + EngineLoop, one barrier per step
        EngineCore = None
    if EngineCore is None:
        from fuseserve.scheduler.engine_loop import EngineLoop
        from fuseserve.scheduler.scheduler import Scheduler

        sched = Scheduler(cfg, [EOS])
        for name in fakes:
            sched.add_worker(name, 1 << 16, 16, 1 << 20)
        loop = EngineLoop(sched, dict(fakes))
        add, poll, cpu = sched.add, loop.step, None
    else:
        core = EngineCore(cfg, [EOS], overlap=overlap)
        for name, fake in fakes.items():
            core.add_worker(name, fake, 1 << 16, 16, 1 << 20, threaded=True)
        add, poll = core.add_request, lambda: core.poll(0.1)
    for _ in range(clients * len(fakes)):
        add(request())
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for ev in poll():
            if ev.finish_reason is not None:
                add(request())
    if EngineCore is not None:
        cpu = core.stats.cpu_per_step_ms()
        core.close()
    out = {"busy": {}, "tokens": {}}
    for name, fake in fakes.items():
        busy, tokens = fake.window(t0, end)
        out["busy"][name] = busy / seconds
        out["tokens"][name] = tokens
    if cpu is not None:
        out["sched_cpu_ms_p50_p99"] = cpu
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients per worker")
    ap.add_argument("--no-overlap", action="store_true")
    a = ap.parse_args()
    for label, slowdowns in (("fast+3x slow", [1.0, 3.0]), ("2 equal", [1.0] * 2), ("8 equal", [1.0] * 8)):
        r = run(slowdowns, a.seconds, a.clients, overlap=not a.no_overlap)
        busy = " ".join(f"{k}={v:.0%}" for k, v in r["busy"].items())
        toks = " ".join(f"{k}={v}" for k, v in r["tokens"].items())
        mean = sum(r["busy"].values()) / len(r["busy"])
        extra = ""
        if "sched_cpu_ms_p50_p99" in r:
            p50, p99 = r["sched_cpu_ms_p50_p99"]
            extra = f"; scheduler CPU/worker-step p50 {p50:.3f} ms p99 {p99:.3f} ms"
        print(f"{label}: busy {busy} (mean {mean:.0%}); tokens {toks}{extra}", flush=True)


if __name__ == "__main__":
    main()
