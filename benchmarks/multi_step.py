"""Multi-step decoding on a simulated clock: plans, tokens/s, TTFT and ITL for each ``--decode-passes``.

A SIMULATION: the real ``Scheduler`` plans for one ``SimulatedRunner`` (``--preset`` x
``--slowdown``) whose sleep advances a simulated clock; plans run one at a time (no overlap, no
transport). Closed-loop clients (zero think time) send prompts of ``--prompt-mean`` and ask
``--output-mean`` tokens (normal, std 0.3 x mean; the shape of ``benchmarks.scale_out``). A token's
time is the end of the pass that sampled it, inside a multi-pass plan too. The scheduler's own CPU
is not modelled: ``benchmarks.scale_out --decode-passes K`` measures it on a real stack.

``python -m benchmarks.multi_step [--passes 1,4,8]``
"""

from __future__ import annotations

import argparse

import numpy as np

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import Sequence
from fuseserve.worker.latency_model import PRESETS
from fuseserve.worker.sim_runner import SimulatedRunner


def run(passes: int, a: argparse.Namespace) -> dict:
    """One closed-loop run with ``decode_passes=passes``; times in simulated seconds."""
    clock = [0.0]
    runner = SimulatedRunner(
        PRESETS[a.preset],
        block_size=16,
        slowdown=a.slowdown,
        sleep=lambda s: clock.__setitem__(0, clock[0] + s),
    )
    one_pass = runner.step_pass
    sampled_at: dict[int, list[float]] = {}  # seq id -> end of each pass that sampled for it

    def timed_pass(plan):
        result = one_pass(plan)
        for t in result.tokens:
            sampled_at.setdefault(t.seq_id, []).append(clock[0])
        return result

    runner.step_pass = timed_pass
    sched = Scheduler(EngineConfig(token_budget=a.token_budget, decode_passes=passes), [])
    sched.add_worker("w", runner.info.num_blocks, 16, runner.info.max_model_len, a.token_budget)
    rng = np.random.default_rng(a.seed)
    arrival: dict[int, float] = {}
    token_times: dict[int, list[float]] = {}

    def send() -> None:
        sid = len(arrival)
        prompt_len = max(1, int(rng.normal(a.prompt_mean, 0.3 * a.prompt_mean)))
        out_len = max(1, int(rng.normal(a.output_mean, 0.3 * a.output_mean)))
        prompt = [int(x) for x in rng.integers(1000, 20000, prompt_len)]
        sched.add(Sequence(sid, prompt, SamplingParams(max_new_tokens=out_len, temperature=0.0).validate()))
        arrival[sid] = clock[0]
        token_times[sid] = []

    for _ in range(a.clients):
        send()
    num_plans = 0
    while sched.has_work:
        plan = sched.schedule().get("w")
        if plan is None:
            continue
        num_plans += 1
        sampled_at.clear()
        result = runner.step(plan)
        finished = 0
        for ev in sched.postprocess("w", result):
            if ev.token is not None:
                token_times[ev.seq_id].append(sampled_at[ev.seq_id].pop(0))
            finished += ev.finish_reason is not None
        for _ in range(finished):
            if len(arrival) < a.requests:
                send()
    ttft = [t[0] - arrival[sid] for sid, t in token_times.items() if t]
    itl = [b - x for t in token_times.values() for x, b in zip(t[:-1], t[1:], strict=True)]
    tokens = sum(len(t) for t in token_times.values())
    return {
        "decode_passes": passes,
        "plans": num_plans,
        "tokens": tokens,
        "tokens_per_s": tokens / clock[0],
        "ttft_p50_ms": float(np.median(ttft) * 1e3),
        "ttft_p95_ms": float(np.percentile(ttft, 95) * 1e3),
        "itl_p50_ms": float(np.median(itl) * 1e3),
        "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", default="1,4,8", help="comma-separated decode_passes values")
    ap.add_argument("--preset", default="a100-llama2-7b", choices=sorted(PRESETS))
    ap.add_argument("--slowdown", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-mean", type=int, default=256)
    ap.add_argument("--output-mean", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print("*** SIMULATED clock and worker; the real scheduler. ***")
    print(
        f"{'K':>3} {'plans':>6} {'tokens':>7} {'tok/s':>7} {'TTFT p50':>9} {'p95':>6} {'ITL p50':>8} {'p99':>6}  (ms)"
    )
    for k in (int(x) for x in a.passes.split(",")):
        r = run(k, a)
        print(
            f"{k:>3} {r['plans']:>6} {r['tokens']:>7} {r['tokens_per_s']:>7.1f} {r['ttft_p50_ms']:>9.0f} "
            f"{r['ttft_p95_ms']:>6.0f} {r['itl_p50_ms']:>8.0f} {r['itl_p99_ms']:>6.0f}"
        )


if __name__ == "__main__":
    main()
