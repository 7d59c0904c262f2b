"""Prefix caching: TTFT, throughput and hit rate with caching on and off, and placement across workers.

Two parts, each side by side in one run:

1. ``pipeline`` (real model, in process): the shared-prefix workload (one 1,024-token system prompt,
   short distinct questions) and the multi-turn chat workload (each turn resends the conversation;
   ``benchmarks/workload.py``), closed-loop clients, on one ``fuseserve.pipeline`` with
   ``prefix_caching`` off and on (two pipelines, the same requests).
2. ``placement`` (SIMULATED, 2 workers): the real ``Scheduler`` with two workers on a simulated
   clock; each pass lasts ``LatencyModel.plan_seconds`` of the ``cpu-smollm2`` preset, which counts
   only the tokens a pass computes, so a cached prefix costs nothing, as on a real worker. The
   shared-prefix workload (1 system prompt, then 8 tenants' prompts with a KV pool too small for all
   of them on one worker), prefix-aware placement against least-loaded placement
   (``EngineConfig.prefix_aware_placement``), both with caching on.

Run: ``python -m benchmarks.prefix_cache [--part pipeline|placement|both]``; writes
``results/prefix_cache.jsonl``. Reported: mean TTFT, total tokens/s (prompt + generated), hit rate
(cached prompt tokens / prompt tokens looked up), and per worker the share of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.metrics import RequestTrace, scale_sla, summarize, write_jsonl
from benchmarks.workload import (
    BenchRequest,
    closed_loop,
    multi_turn_requests,
    send_from_blocking,
    shared_prefix_requests,
)
from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import Sequence
from fuseserve.types import SampledToken, StepResult
from fuseserve.worker.latency_model import PRESETS

RESULTS = Path(__file__).parent / "results"
SLA = scale_sla(factor=16.0)  # only for ``summarize``'s SLA fields; this benchmark reads TTFT and tokens/s


def hit_rate(sched: Scheduler, q0: int = 0, h0: int = 0) -> float:
    """Cached prompt tokens / prompt tokens looked up, since the counters were ``q0`` / ``h0``."""
    q = sched.num_prefix_queries - q0
    return (sched.num_prefix_hits - h0) / q if q else 0.0


# ------------------------------------------------------------------------------------------ pipeline
def run_pipeline(model: str, budget: int, clients: int, num_requests: int, out: Path) -> list[dict]:
    import fuseserve
    from benchmarks.token_stream import stream_tokens

    records = []
    pipes = {
        caching: fuseserve.pipeline(
            model,
            token_budget=budget,
            kv_cache_memory="512MiB",
            dtype="float32",
            progress=False,
            prefix_caching=caching,
        )  # fmt: skip
        for caching in (False, True)
    }
    try:
        tok = pipes[True].tokenizer
        workloads = {
            "shared-prefix": shared_prefix_requests(tok, num_requests, system_len=1024, seed=1),
            "multi-turn": multi_turn_requests(tok, clients, max(2, num_requests // clients), seed=2),
        }
        for name, reqs in workloads.items():
            for caching, pipe in pipes.items():
                send = send_from_blocking(
                    lambda r, p=pipe: stream_tokens(p, r.prompt_token_ids, r.max_new_tokens)
                )
                asyncio.run(
                    closed_loop([BenchRequest(reqs[0].prompt_token_ids[:16], "", 2)], send, 1)
                )  # warm up
                q0, h0 = pipe.scheduler.num_prefix_queries, pipe.scheduler.num_prefix_hits
                res = asyncio.run(closed_loop(reqs, send, clients))
                rec = summarize(res.traces, res.wall_seconds, SLA)
                rec |= {"part": "pipeline", "workload": name, "prefix_caching": caching, "clients": clients,
                        "token_budget": budget, "hit_rate": hit_rate(pipe.scheduler, q0, h0)}  # fmt: skip
                print(
                    f"pipeline {name:13s} caching={'on ' if caching else 'off'}: mean TTFT "
                    f"{rec['mean_ttft_s']:.3f} s, {rec['total_tokens_per_s']:.0f} tok/s total, "
                    f"hit rate {rec['hit_rate']:.1%} ({len(reqs)} requests, {clients} clients)",
                    flush=True,
                )
                records.append(rec)
                write_jsonl(out, rec)
    finally:
        for p in pipes.values():
            p.close()
    return records


# ----------------------------------------------------------------------------------------- placement
@dataclass
class _Lane:
    plan: object = None
    starts_at: float = 0.0
    ends_at: float = 0.0
    free_at: float = 0.0


def simulate_placement(
    requests: list[BenchRequest], clients: int, prefix_aware: bool, num_blocks: int, budget: int = 256
) -> dict:
    """Closed-loop clients against the real ``Scheduler`` with 2 workers on a simulated clock.

    Each worker runs one plan at a time (no overlap) lasting ``cpu-smollm2``'s ``plan_seconds``; a
    token's time is the end of the pass that sampled it. Returns the ``summarize`` record plus the hit
    rate and each worker's share of the requests.
    """
    model = PRESETS["cpu-smollm2"]
    cfg = EngineConfig(token_budget=budget, block_size=16, prefix_aware_placement=prefix_aware)
    sched = Scheduler(cfg, [])
    lanes = {w: _Lane() for w in ("w0", "w1")}
    for w in lanes:
        sched.add_worker(w, num_blocks, 16, 1 << 20, budget)
    traces: dict[int, RequestTrace] = {}
    placed: dict[int, str] = {}
    now, sent = 0.0, 0

    def send() -> None:
        nonlocal sent
        r = requests[sent]
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
        sched.add(Sequence(sent, list(r.prompt_token_ids), params))
        traces[sent] = RequestTrace(now, [], len(r.prompt_token_ids), 0)
        sent += 1

    for _ in range(min(clients, len(requests))):
        send()
    while sched.has_work:
        for name, lane in lanes.items():
            if lane.plan is None:
                plan = sched.schedule_worker(name)
                if plan is not None:
                    lane.starts_at = max(now, lane.free_at)
                    lane.plan, lane.ends_at = plan, lane.starts_at + model.plan_seconds(plan)
        busy = [(lane.ends_at, name) for name, lane in lanes.items() if lane.plan is not None]
        if not busy:
            raise RuntimeError("simulation stalled: work left but no plan")
        now, name = min(busy)
        lane = lanes[name]
        plan, lane.plan, lane.free_at = lane.plan, None, now
        for c in plan.chunks:
            placed.setdefault(c.seq_id, name)
        tokens = [SampledToken(c.seq_id, 1000) for c in plan.chunks if c.sample]
        finished = 0
        for ev in sched.postprocess(name, StepResult(plan.step_id, tokens, now - lane.starts_at)):
            tr = traces[ev.seq_id]
            if ev.token is not None:
                tr.token_times.append(now)
                tr.output_tokens += 1
            if ev.finish_reason is not None:
                tr.end = now
                finished += 1
        for _ in range(finished):
            if sent < len(requests):
                send()
    rec = summarize([traces[i] for i in sorted(traces)], now, SLA)
    counts = {w: sum(1 for v in placed.values() if v == w) for w in lanes}
    rec |= {"hit_rate": hit_rate(sched), "requests_per_worker": counts,
            "max_worker_share": max(counts.values()) / max(1, sum(counts.values()))}  # fmt: skip
    return rec


def run_placement(model: str, clients: int, num_requests: int, out: Path) -> list[dict]:
    from fuseserve.model_source import resolve_model

    tok = resolve_model(model, progress=False).load_tokenizer()
    records = []
    cases = {  # name: (requests, KV blocks per worker)
        "1 system prompt": (shared_prefix_requests(tok, num_requests, 1024, seed=3), 512),
        "8 system prompts": (shared_prefix_requests(tok, num_requests, 1024, seed=4, num_prefixes=8), 400),
    }
    for case, (reqs, blocks) in cases.items():
        for aware in (False, True):
            rec = simulate_placement(reqs, clients, aware, blocks)
            rec |= {"part": "placement (simulated, cpu-smollm2)", "workload": f"shared-prefix, {case}",
                    "placement": "prefix-aware" if aware else "least-loaded", "clients": clients,
                    "kv_blocks_per_worker": blocks}  # fmt: skip
            print(
                f"placement {case:16s} {rec['placement']:12s}: mean TTFT {rec['mean_ttft_s']:.3f} s "
                f"(simulated), {rec['total_tokens_per_s']:.0f} tok/s, hit rate {rec['hit_rate']:.1%}, "
                f"requests per worker {rec['requests_per_worker']}",
                flush=True,
            )
            records.append(rec)
            write_jsonl(out, rec)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["pipeline", "placement", "both"], default="both")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--clients", type=int, default=4, help="pipeline clients (default: 4)")
    ap.add_argument("--requests", type=int, default=8, help="pipeline requests per workload (default: 8)")
    ap.add_argument("--sim-clients", type=int, default=16, help="placement clients (default: 16)")
    ap.add_argument("--sim-requests", type=int, default=256, help="placement requests (default: 256)")
    ap.add_argument("--out", default=str(RESULTS / "prefix_cache.jsonl"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    if args.part in ("placement", "both"):
        run_placement(args.model, args.sim_clients, args.sim_requests, out)
    if args.part in ("pipeline", "both"):
        run_pipeline(args.model, args.token_budget, args.clients, args.requests, out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
