"""GPU-scale projection: the REAL scheduler on a simulated clock with a modelled forward pass.

This is a SIMULATION. It runs `fuseserve.scheduler.scheduler.Scheduler` (the same policies the
engine uses) against a fake worker that samples a dummy token and advances a simulated clock by
`LatencyModel.pass_seconds` of each step plan. Closed-loop clients (zero think time) replay the
paper's workload shape: prompt/output means 2600/60 and 1200/128, standard deviation 0.3 x mean
(DeepSpeed-FastGen, Holmes et al. 2024, performance evaluation). Metrics are computed by
`benchmarks.metrics.summarize` with the paper's unscaled service level (the modelled GPU is the
paper's).

The latency model (a roofline per forward pass, stated inputs, nothing fitted to the paper's
results) and its presets live in ``fuseserve.worker.latency_model``, which simulated gRPC workers
(``fuseserve worker --simulate PRESET``) use too: one implementation.

With ``--target-itl`` / ``--target-prefill-rate`` SplitFuse also runs with each pass sized from the
targets (``fuseserve.scheduler.slo_budget``), printed beside the knee-budget run of the same command.
Its latency prior is what a real worker's start-up profile gives (prompt-only passes of
``PROFILE_SIZES`` tokens, here from the preset); the effect of context and sequence count is learned
online from the simulated passes, as on a real worker.

With ``--hetero F,F,...`` it runs placement instead: one simulated worker per slowdown (each pass
``plan_seconds x F``, each worker on its own lane of the clock, its pass times fitted by placement)
against the fastest worker alone, same requests and clients (``simulate_workers``).

Run: ``python -m benchmarks.simulate`` (A100 + A6000 presets, both workload shapes);
``python -m benchmarks.simulate --target-itl 0.25 --target-prefill-rate 512``;
``python -m benchmarks.simulate --hetero 4,12 --clients 16,32,64 --requests-per-client 4``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.metrics import RequestTrace, scale_sla, summarize, write_jsonl
from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.slo_budget import curve_prior
from fuseserve.types import SampledToken, StepPlan, StepResult
from fuseserve.worker.latency_model import PRESETS, PROFILE_SIZES, LatencyModel

WORKLOADS = {"2600/60": (2600, 60), "1200/128": (1200, 128)}


@dataclass
class SimRequest:
    prompt_len: int
    output_len: int


@dataclass
class SimResult:
    """One simulated run: traces (simulated seconds), wall time, and pass statistics."""

    traces: list[RequestTrace]
    wall_seconds: float
    num_passes: int
    max_pass_tokens: int
    pass_tokens: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # the token budget chosen for each pass


def make_sim_requests(
    num: int, prompt_mean: float, output_mean: float, seed: int, std_frac: float = 0.3, max_len: int = 4096
) -> list[SimRequest]:
    """Normal lengths (std = std_frac x mean), clipped to [1, mean + 3 std] and to ``max_len`` in total."""
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        x = np.rint(rng.normal(mean, std_frac * mean, size=num))
        return np.clip(x, 1, int(mean * (1 + 3 * std_frac))).astype(int)

    prompts, outputs = draw(prompt_mean), draw(output_mean)
    return [SimRequest(int(min(p, max_len - o)), int(o)) for p, o in zip(prompts, outputs, strict=True)]


class SimWorker:
    """A fake worker: samples token 0 for every sampling chunk and advances the simulated clock."""

    def __init__(self, model: LatencyModel):
        self.model = model
        self.now = 0.0  # simulated seconds
        self.pass_tokens: list[int] = []

    def step(self, plan: StepPlan) -> StepResult:
        seconds = self.model.plan_seconds(plan) if plan.chunks else 0.0
        self.now += seconds
        if plan.chunks:
            self.pass_tokens.append(plan.num_tokens)
        tokens = [SampledToken(c.seq_id, 0) for c in plan.chunks if c.sample]
        return StepResult(plan.step_id, tokens, seconds)


def simulate(
    model: LatencyModel,
    requests: Seq[SimRequest],
    num_clients: int,
    policy: str,
    token_budget: int,
    block_size: int = 16,
    max_steps: int = 10_000_000,
    target_itl: float | None = None,
    target_prefill_rate: float | None = None,
) -> SimResult:
    """Closed-loop clients on a simulated clock against the real `Scheduler` with ``policy``.

    Each client sends its next request the moment its previous one finishes (at the end of that
    pass). A token's timestamp is the end of the pass that sampled it. With targets, the scheduler
    sizes passes from them (its clock is the simulated one).
    """
    config = EngineConfig(
        token_budget=token_budget,
        policy=policy,
        block_size=block_size,
        target_itl=target_itl,
        target_prefill_rate=target_prefill_rate,
    )
    worker = SimWorker(model)
    sched = Scheduler(config, [], clock=lambda: worker.now)
    num_blocks = max(1, model.kv_capacity_tokens // block_size)
    profile = {n: model.latency(n) for n in PROFILE_SIZES}
    sched.add_worker("sim", num_blocks, block_size, 1 << 20, token_budget, latency_prior=curve_prior(profile))
    budgets: list[int] = []
    sched.pass_observers.append(lambda _worker, budget, _tokens: budgets.append(budget))
    traces: dict[int, RequestTrace] = {}
    next_req = 0

    def send() -> None:
        nonlocal next_req
        r = requests[next_req]
        sid = next_req
        next_req += 1
        params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        # distinct prompts (the paper's workload shares no prefix): the first token differs, so with
        # prefix caching on no block hash repeats across requests
        sched.add(Sequence(sid, [sid + 1] + [0] * (r.prompt_len - 1), params))
        traces[sid] = RequestTrace(worker.now, [], r.prompt_len, 0)

    for _ in range(min(num_clients, len(requests))):
        send()
    steps = 0
    while sched.has_work:
        steps += 1
        if steps > max_steps:
            raise RuntimeError("simulation did not finish (scheduler made no progress?)")
        plans = sched.schedule()
        if "sim" not in plans:
            continue
        result = worker.step(plans["sim"])
        finished = 0
        for ev in sched.postprocess("sim", result):
            tr = traces[ev.seq_id]
            if ev.token is not None:
                tr.token_times.append(worker.now)
                tr.output_tokens += 1
            if ev.finish_reason is not None:
                tr.end = worker.now
                finished += 1
        for _ in range(finished):
            if next_req < len(requests):
                send()
    ordered = [traces[i] for i in sorted(traces)]
    return SimResult(
        ordered,
        max(worker.now, 1e-9),
        len(worker.pass_tokens),
        max(worker.pass_tokens, default=0),
        worker.pass_tokens,
        budgets,
    )


def simulate_workers(
    model: LatencyModel,
    slowdowns: Seq[float],
    requests: Seq[SimRequest],
    num_clients: int,
    token_budget: int,
    block_size: int = 16,
) -> dict:
    """Closed-loop clients against the real `Scheduler` with one worker per slowdown (each pass takes
    ``plan_seconds x slowdown``), on a simulated clock: each worker runs one plan at a time and reports
    its pass time, which placement fits. Returns tokens/s (generated tokens ÷ time to the last
    answer), each worker's share of the tokens, mean and p95 request latency."""
    sched = Scheduler(EngineConfig(token_budget=token_budget, block_size=block_size), [])
    lanes = {
        f"w{i}": {"plan": None, "start": 0.0, "end": 0.0, "f": f, "tokens": 0}
        for i, f in enumerate(slowdowns)
    }
    for name in lanes:
        sched.add_worker(name, model.kv_capacity_tokens // block_size, block_size, 1 << 20, token_budget)
    now, sent, started, latencies = 0.0, 0, {}, []

    def send() -> None:
        nonlocal sent
        r = requests[sent]
        params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        sched.add(Sequence(sent, [sent + 1] + [0] * (r.prompt_len - 1), params))
        started[sent], sent = now, sent + 1

    for _ in range(min(num_clients, len(requests))):
        send()
    while sched.has_work:
        for name, lane in lanes.items():
            if lane["plan"] is None and (plan := sched.schedule_worker(name)) is not None:
                lane["plan"], lane["start"] = plan, now
                lane["end"] = now + model.plan_seconds(plan) * lane["f"]
        now, name = min((lane["end"], n) for n, lane in lanes.items() if lane["plan"] is not None)
        lane = lanes[name]
        plan, lane["plan"] = lane["plan"], None
        tokens = [SampledToken(c.seq_id, 0) for c in plan.chunks if c.sample]
        lane["tokens"] += len(tokens)
        for ev in sched.postprocess(name, StepResult(plan.step_id, tokens, now - lane["start"])):
            if ev.finish_reason is not None:
                latencies.append(now - started[ev.seq_id])
                if sent < len(requests):
                    send()
    total = sum(lane["tokens"] for lane in lanes.values())
    return {
        "slowdowns": list(slowdowns),
        "clients": num_clients,
        "tokens_per_s": total / now,
        "token_share": [lane["tokens"] / total for lane in lanes.values()],
        "mean_latency_s": float(np.mean(latencies)),
        "p95_latency_s": float(np.percentile(latencies, 95)),
    }


def run_hetero(model: LatencyModel, slowdowns: list[float], clients: Seq[int], workload: tuple[int, int],
               requests_per_client: int, seed: int) -> list[dict]:  # fmt: skip
    """The fastest worker alone, then all ``slowdowns`` together, for each client count; printed."""
    records = []
    for n in clients:
        reqs = make_sim_requests(requests_per_client * n, *workload, seed=seed + n)
        alone = simulate_workers(model, [min(slowdowns)], reqs, n, model.knee())
        group = simulate_workers(model, slowdowns, reqs, n, model.knee())
        group["vs_fastest_alone"] = group["tokens_per_s"] / alone["tokens_per_s"]
        print(
            f"   clients {n:>3}: fastest alone {alone['tokens_per_s']:7.1f} tok/s, latency "
            f"{alone['mean_latency_s']:6.2f} s | slowdowns {slowdowns}: {group['tokens_per_s']:7.1f} tok/s "
            f"(x{group['vs_fastest_alone']:.3f}), token shares {[round(x, 3) for x in group['token_share']]}, "
            f"latency {group['mean_latency_s']:6.2f} s, p95 {group['p95_latency_s']:6.2f} s"
        )
        records += [
            alone | {"workload": f"{workload[0]}/{workload[1]}"},
            group | {"workload": f"{workload[0]}/{workload[1]}"},
        ]
    return records


def run_grid(
    model: LatencyModel,
    workload: tuple[int, int],
    clients: Seq[int],
    requests_per_client: int,
    min_requests: int,
    seed: int,
    policies: Seq[str] = ("splitfuse", "prefill_first"),
    token_budget: int | None = None,
    targets: tuple[float | None, float | None] = (None, None),
) -> list[dict]:
    """Every (policy, clients) cell; returns `summarize` records with the simulation's inputs added.

    ``targets``: ``(target_itl, target_prefill_rate)``; with any, a ``splitfuse+slo`` cell (SplitFuse
    sized from the targets) is added to each client count.
    """
    budget = token_budget or model.knee()
    sla = scale_sla(factor=1.0)
    records = []
    runs = [(p, (None, None)) for p in policies]
    if any(t is not None for t in targets):
        runs.append(("splitfuse", targets))
    for n in clients:
        reqs = make_sim_requests(max(min_requests, requests_per_client * n), *workload, seed=seed + n)
        for policy, (itl, rate) in runs:
            res = simulate(model, reqs, n, policy, budget, target_itl=itl, target_prefill_rate=rate)
            rec = summarize(res.traces, res.wall_seconds, sla)
            rec |= {
                "simulation": True,
                "system": "sim:" + model.name,
                "policy": policy + ("+slo" if itl or rate else ""),
                "target_itl_s": itl,
                "target_prefill_rate": rate,
                "clients": n,
                "workload": f"{workload[0]}/{workload[1]}",
                "token_budget": budget,
                "num_passes": res.num_passes,
                "max_pass_tokens": res.max_pass_tokens,
                "mean_pass_tokens": float(np.mean(res.pass_tokens)) if res.pass_tokens else 0.0,
                "mean_chosen_budget": float(np.mean(res.budgets)) if res.budgets else 0.0,
                "max_chosen_budget": max(res.budgets, default=0),
            }
            records.append(rec)
    return records


def _ratio(a: float | None, b: float | None) -> float:
    return float("nan") if not a or not b else a / b


def report(records: list[dict], token_rate: str = "4") -> list[str]:
    """Table lines plus SplitFuse / prefill_first ratios per client count (knee budget, and sized
    from the targets where a ``splitfuse+slo`` cell exists). ``budget``: mean chosen budget per pass."""
    lines = [
        f"{'clients':>7} {'policy':>14} {'req/s':>7} {'eff req/s@' + token_rate:>13} "
        f"{'P50 tok s':>9} {'P95 tok s':>9} {'TTFT s':>7} {'passes':>7} {'budget':>7} {'tok/pass':>8}"
    ]
    by = {(r["clients"], r["policy"]): r for r in records}
    for r in records:
        lines.append(
            f"{r['clients']:>7} {r['policy']:>14} {r['requests_per_s']:>7.2f} "
            f"{r['effective_requests_per_s'][token_rate]:>13.2f} {r['token_latency_p50_s']:>9.4f} "
            f"{r['token_latency_p95_s']:>9.4f} {r['mean_ttft_s']:>7.3f} {r['num_passes']:>7} "
            f"{r.get('mean_chosen_budget', 0.0):>7.0f} {r['mean_pass_tokens']:>8.0f}"
        )
    for n in sorted({r["clients"] for r in records}):
        pf = by.get((n, "prefill_first"))
        for name in ("splitfuse", "splitfuse+slo"):
            sf = by.get((n, name))
            if not (sf and pf):
                continue
            eff = _ratio(
                sf["effective_requests_per_s"][token_rate], pf["effective_requests_per_s"][token_rate]
            )
            p95 = _ratio(pf["token_latency_p95_s"], sf["token_latency_p95_s"])
            lines.append(
                f"  clients={n:>2}: {name + '/prefill_first':>27} effective throughput x{eff:.2f}, "
                f"P95 token latency {p95:.2f}x lower"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="SIMULATION of SplitFuse vs prefill_first at GPU scale.")
    ap.add_argument("--preset", choices=sorted(PRESETS), action="append")
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--min-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-budget", type=int, default=None, help="default: the model's knee")
    ap.add_argument(
        "--target-itl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also run SplitFuse with passes sized to keep this inter-token latency (splitfuse+slo)",
    )
    ap.add_argument(
        "--target-prefill-rate",
        type=float,
        default=None,
        metavar="TOKENS_PER_S",
        help="TTFT target = prompt tokens / this rate for the splitfuse+slo run (the paper's SLA: 512)",
    )
    ap.add_argument(
        "--hetero",
        default=None,
        metavar="F,F,...",
        help="instead: workers of these slowdowns (e.g. 4,12) against the fastest alone (placement)",
    )
    ap.add_argument("--workload", default=None, help="with --hetero: PROMPT/OUTPUT means (default 512/64)")
    ap.add_argument("--out", default="benchmarks/results/simulate.jsonl")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    out = Path(args.out)
    out.unlink(missing_ok=True)
    print("*** SIMULATION: real Scheduler, modelled forward pass, simulated clock. Not a measurement. ***")
    if args.hetero:
        wl = tuple(int(x) for x in (args.workload or "512/64").split("/"))
        for key in args.preset or ["a100-llama2-7b"]:
            print(
                f"== {PRESETS[key].name}, workload {wl[0]}/{wl[1]}, {args.requests_per_client} requests per client"
            )
            slowdowns = [float(f) for f in args.hetero.split(",")]
            for r in run_hetero(PRESETS[key], slowdowns, clients, wl, args.requests_per_client, args.seed):
                write_jsonl(out, r | {"preset": key})
        return
    for key in args.preset or ["a100-llama2-7b", "a6000-llama2-7b"]:
        model = PRESETS[key]
        budget = args.token_budget or model.knee()
        print(f"\n== {model.name}: inputs {json.dumps(asdict(model))}")
        print(
            "   latency(n): "
            + ", ".join(
                f"{n}: {model.latency(n) * 1e3:.1f} ms ({n / model.latency(n):.0f} tok/s)"
                for n in (1, 64, 128, 256, 512, 1024, 2048)
            )
        )
        print(
            f"   token budget (knee at 90% of peak throughput): {budget}; KV capacity "
            f"{model.kv_capacity_tokens} tokens; SLA: the paper's (TTFT <= prompt/512 s, EMA rate >= 2/4/6 tok/s)"
        )
        for wname, wl in WORKLOADS.items():
            records = run_grid(
                model,
                wl,
                clients,
                args.requests_per_client,
                args.min_requests,
                args.seed,
                token_budget=budget,
                targets=(args.target_itl, args.target_prefill_rate),
            )
            for r in records:
                write_jsonl(out, r | {"preset": key})
            print(f"-- workload prompt/output means {wname} (SIMULATION)")
            for line in report(records):
                print("   " + line)
    print(
        f"\nrecords: {out}  (SIMULATION; the paper reports up to 2.3x effective throughput and "
        f"3.7x lower P95 token latency vs vLLM on real hardware)"
    )


if __name__ == "__main__":
    main()
