"""Scale-out: a real stack (Redis, scheduler, gateway) feeding N SIMULATED workers.

The workers are ``fuseserve worker --simulate PRESET --simulate-slowdown F``: the real gRPC worker
with a latency model instead of a model (``fuseserve.worker.sim_runner``), so the control plane is
measured as it would run against N GPUs. One control plane (started like ``fuseserve serve``) is
kept for the whole run; for each N the previous workers stop and N new ones register.

Per N, closed-loop clients (``--clients-per-worker`` x N, zero think time) send non-streaming
``/v1/completions`` requests with token-id prompts (lengths normal, std 0.3 x mean, like the paper's
workload) for ``--warmup`` seconds, then a measured window of ``--seconds``. Reported:

- generated tokens/s: tokens the workers sampled in the window (their ``fuseserve_sampled_tokens``
  metric) ÷ window; the clients' count (usage of requests finished in the window) is stored too;
- scaling efficiency: tokens/s at N ÷ (N x tokens/s at 1);
- each worker's busy fraction: increase of its ``fuseserve_forward_time_seconds_sum`` ÷ window;
- scheduler CPU per worker-step: the scheduler exposes no per-step CPU figure, so this is the
  scheduler PROCESS's CPU time (``/proc/PID/stat``, user + system, all threads) in each 1-s
  interval ÷ the worker steps in that interval (sum of the workers' ``fuseserve_forward_time_seconds_count``);
  p50 / p99 are over those intervals, and ``mean`` is the whole window's CPU ÷ its steps;
- CPU used by each control-plane process (scheduler, gateway, Redis), all workers and this client,
  in cores, so the machine's headroom is visible;
- with ``--decode-passes K``: the scheduler plans up to K decode passes per plan (multi-step); a
  worker-step is still one pass (the workers count each pass in their metrics);
- a heterogeneous run: 2 workers with slowdowns ``--hetero`` (default 1,3): each one's busy fraction
  and the fast / slow ratio of generated tokens.

``python -m benchmarks.scale_out [--quick]`` writes ``results/scale_out[_quick].jsonl`` and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import redis

from benchmarks.metrics import write_jsonl
from benchmarks.plots import plot_scale_out
from fuseserve import messages
from fuseserve.cli import serve_args
from fuseserve.launcher import Stack, start_stack, worker_argv
from fuseserve.redis_launcher import free_port
from fuseserve.worker.latency_model import PRESETS
from fuseserve.worker.sim_runner import SIM_FIRST_TOKEN, SIM_VOCAB_SIZE

MODEL = "smollm2-135m-instruct"  # the gateway's tokenizer
CLK_TCK = os.sysconf("SC_CLK_TCK")
BAR = "{l_bar}{bar}| {elapsed} {postfix}"
SAMPLE_S = 1.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


@dataclass
class WorkerProbe:
    """One simulated worker: its process, metrics port and counters at the window's start."""

    worker_id: str
    pid: int
    metrics_port: int
    slowdown: float
    start: dict[str, float] = field(default_factory=dict)


async def scrape(client: httpx.AsyncClient, port: int) -> dict[str, float]:
    """Busy seconds, steps and sampled tokens from a worker's Prometheus text (summed over labels)."""
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for key in (
            "fuseserve_forward_time_seconds_sum",
            "fuseserve_forward_time_seconds_count",
            "fuseserve_sampled_tokens_total",
        ):
            if line.startswith((key + " ", key + "{")):
                out[key] = out.get(key, 0.0) + float(line.rsplit(maxsplit=1)[1])
    return out


@dataclass
class Load:
    """Closed-loop clients; counts requests and tokens finished inside the measured window."""

    base: str
    prompt_mean: int
    output_mean: int
    seed: int
    window: tuple[float, float] = (float("inf"), float("inf"))
    done_requests: int = 0
    done_tokens: int = 0
    errors: int = 0
    stop: bool = False
    left: int | None = None  # a burst: requests still to send (None: until stopped)
    last_done: float = 0.0  # when the last request finished (time.monotonic)
    latencies: list[float] = field(default_factory=list)

    def draw(self, rng: np.random.Generator, mean: int) -> int:
        return int(np.clip(np.rint(rng.normal(mean, 0.3 * mean)), 1, mean * 1.9))

    async def client(self, http: httpx.AsyncClient, index: int) -> None:
        rng = np.random.default_rng(self.seed * 100_003 + index)
        while not self.stop and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            prompt = rng.integers(SIM_FIRST_TOKEN, SIM_VOCAB_SIZE, self.draw(rng, self.prompt_mean)).tolist()
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": self.draw(rng, self.output_mean),
                "temperature": 0.0,
                "ignore_eos": True,
            }
            sent = time.monotonic()
            try:
                r = await http.post(f"{self.base}/v1/completions", json=body)
                r.raise_for_status()
                tokens = r.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, KeyError, ValueError):
                self.errors += 1
                await asyncio.sleep(0.1)
                continue
            now = time.monotonic()
            if self.window[0] <= now <= self.window[1]:
                self.done_requests += 1
                self.done_tokens += tokens
                self.latencies.append(now - sent)
                self.last_done = now


class Bench:
    """The control plane (one ``Stack``) and the current set of simulated workers."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.serve = serve_args(
            model=MODEL,
            workers=1,
            port=free_port(),
            simulate=args.preset,
            simulate_slowdown=str(args.slowdown),
            log_level="WARNING",
            decode_passes=args.decode_passes,
            migration=args.migration,
        )
        self.stack: Stack | None = None
        self.base = ""
        self.workers: list[WorkerProbe] = []
        self.generation = 0
        self.bar = None

    def start(self) -> None:
        self.stack, self.base = start_stack(self.serve)
        self.r = redis.Redis.from_url(self.stack.redis.url, decode_responses=True)
        self.workers = self._probes(["worker-0"], [self.args.slowdown])

    def pid(self, name: str) -> int:
        return next(p.pid for n, p in self.stack.procs if n == name)

    def _probes(self, ids: list[str], slowdowns: list[float]) -> list[WorkerProbe]:
        """Wait until every worker id has a Redis record and the scheduler lists it; return probes."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.stack.check_alive()
            recs = {i: self.r.get(messages.worker_key(i)) for i in ids}
            stats = messages.read_scheduler_stats(self.r)
            if all(recs.values()) and set(ids) == set(stats.get("workers", {})):
                return [
                    WorkerProbe(i, self.pid(i), messages.WorkerRecord.decode(recs[i]).metrics_port, f)
                    for i, f in zip(ids, slowdowns, strict=True)
                ]
            time.sleep(0.2)
        raise RuntimeError(f"workers {ids} did not all join the scheduler")

    def set_workers(self, slowdowns: list[float]) -> None:
        """Stop the current workers and start ``len(slowdowns)`` new ones with these slowdowns
        (nothing to do when the current ones already have them)."""
        if [w.slowdown for w in self.workers] == slowdowns:
            return
        for w in self.workers:
            proc = next(p for n, p in self.stack.procs if n == w.worker_id)
            proc.terminate()
        for w in self.workers:
            proc = next(p for n, p in self.stack.procs if n == w.worker_id)
            proc.wait(timeout=30)
        gone = {w.worker_id for w in self.workers}
        self.stack.procs = [(n, p) for n, p in self.stack.procs if n not in gone]
        self.generation += 1
        ids = [f"g{self.generation}-w{i}" for i in range(len(slowdowns))]
        for i, (wid, f) in enumerate(zip(ids, slowdowns, strict=True)):
            opts = replace(self.serve, simulate_slowdown=str(f))
            self.stack.spawn(wid, worker_argv(opts, self.stack.redis.url, i, worker_id=wid))
        self.workers = self._probes(ids, slowdowns)

    async def measure(self, label: str, clients: int) -> dict:
        """Warm up, then measure one window with ``clients`` closed-loop clients."""
        a = self.args
        load = Load(self.base, a.prompt_mean, a.output_mean, a.seed + clients, left=a.burst)
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
        async with (
            httpx.AsyncClient(timeout=600, limits=limits) as http,
            httpx.AsyncClient(timeout=10) as probe,
        ):

            def start() -> list[asyncio.Task]:
                return [asyncio.create_task(load.client(http, i)) for i in range(clients)]

            tasks = [] if a.burst else start()
            await self._tick(0.0 if a.burst else a.warmup, label, "warm-up")
            procs = {"scheduler": self.pid("scheduler"), "gateway": self.pid("gateway")}
            if self.stack.redis.process is not None:
                procs["redis"] = self.stack.redis.process.pid
            cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
            wcpu0 = sum(cpu_seconds(w.pid) for w in self.workers)
            me0 = time.process_time()
            for w in self.workers:
                w.start = await scrape(probe, w.metrics_port)
            t0 = time.monotonic()
            load.window = (t0, float("inf") if a.burst else t0 + a.seconds)
            tasks = start() if a.burst else tasks  # a burst: from the first request to the last answer
            intervals: list[float] = []
            last_cpu, last_steps, last_t = cpu0["scheduler"], self._steps([w.start for w in self.workers]), t0
            while not all(t.done() for t in tasks) if a.burst else time.monotonic() < t0 + a.seconds:
                await (asyncio.wait(tasks, timeout=SAMPLE_S) if a.burst else asyncio.sleep(SAMPLE_S))
                now = await asyncio.gather(*(scrape(probe, w.metrics_port) for w in self.workers))
                cpu, steps = cpu_seconds(procs["scheduler"]), self._steps(now)
                if steps > last_steps:
                    intervals.append((cpu - last_cpu) * 1e3 / (steps - last_steps))
                last_cpu, last_steps = cpu, steps
                tok = sum(
                    s["fuseserve_sampled_tokens_total"] - w.start["fuseserve_sampled_tokens_total"]
                    for s, w in zip(now, self.workers, strict=True)
                )
                self._advance(time.monotonic() - last_t, label, f"{tok / (time.monotonic() - t0):.0f} tok/s")
                last_t = time.monotonic()
            end = await asyncio.gather(*(scrape(probe, w.metrics_port) for w in self.workers))
            wall = (load.last_done if a.burst else time.monotonic()) - t0
            cpu1 = {k: cpu_seconds(p) for k, p in procs.items()}
            wcpu1 = sum(cpu_seconds(w.pid) for w in self.workers)
            me1 = time.process_time()
            load.stop = True
            for t in tasks:  # disconnects abort the requests in flight
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._drain(since=time.time())
        deltas = [{k: e[k] - w.start.get(k, 0.0) for k in e} for e, w in zip(end, self.workers, strict=True)]
        tokens = [d["fuseserve_sampled_tokens_total"] for d in deltas]
        steps = sum(d["fuseserve_forward_time_seconds_count"] for d in deltas)
        busy = [d["fuseserve_forward_time_seconds_sum"] / wall for d in deltas]
        sched_cpu = cpu1["scheduler"] - cpu0["scheduler"]
        cores = {k: (cpu1[k] - cpu0[k]) / wall for k in procs}
        cores |= {"workers": (wcpu1 - wcpu0) / wall, "client": (me1 - me0) / wall}
        return {
            "label": label,
            "workers": len(self.workers),
            "slowdowns": [w.slowdown for w in self.workers],
            "clients": clients,
            "window_s": wall,
            "gen_tokens_per_s": sum(tokens) / wall,
            "client_tokens_per_s": load.done_tokens / wall,
            "client_requests": load.done_requests,
            "client_errors": load.errors,
            "worker_tokens": tokens,
            "worker_busy": busy,
            "busy_min": min(busy),
            "busy_mean": statistics.fmean(busy),
            "worker_steps": steps,
            "sched_cpu_ms_per_step_mean": sched_cpu * 1e3 / steps if steps else float("nan"),
            "sched_cpu_ms_per_step_p50": percentile(intervals, 50),
            "sched_cpu_ms_per_step_p99": percentile(intervals, 99),
            "cpu_cores": cores,
            "loadavg_1m": os.getloadavg()[0],
            "burst": a.burst,
            "mean_latency_s": statistics.fmean(load.latencies) if load.latencies else float("nan"),
        }

    def _drain(self, since: float, timeout: float = 60.0) -> None:
        """Wait until the scheduler reports (after ``since``, epoch s) that it holds no sequence."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = messages.read_scheduler_stats(self.r)
            idle = stats.get("waiting", 1) == 0 and stats.get("running", 1) == 0
            if idle and stats.get("time", 0) > since:
                return
            time.sleep(0.2)

    @staticmethod
    def _steps(snaps: list[dict[str, float]]) -> float:
        return sum(s.get("fuseserve_forward_time_seconds_count", 0.0) for s in snaps)

    async def _tick(self, seconds: float, label: str, what: str) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            step = min(SAMPLE_S, left)
            await asyncio.sleep(step)
            self._advance(step, label, what)

    def _advance(self, seconds: float, label: str, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label}: {what}", refresh=False)
            self.bar.update(max(0.0, min(seconds, self.bar.total - self.bar.n)))

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()


def efficiency(records: list[dict]) -> None:
    """Add ``efficiency`` = tok/s at N ÷ (N x tok/s at 1) to the homogeneous records."""
    one = next((r for r in records if r["label"] == "scale" and r["workers"] == 1), None)
    for r in records:
        if r["label"] == "scale" and one and one["gen_tokens_per_s"] > 0:
            r["efficiency"] = r["gen_tokens_per_s"] / (r["workers"] * one["gen_tokens_per_s"])


def report(records: list[dict]) -> list[str]:
    lines = [
        f"{'N':>3} {'clients':>7} {'gen tok/s':>9} {'client tok/s':>12} {'eff':>5} {'busy min':>8} "
        f"{'busy mean':>9} {'sched ms/step p50':>17} {'p99':>6} {'mean':>6}  cores: sched gw redis workers client"
    ]
    for r in records:
        c = r["cpu_cores"]
        lines.append(
            f"{r['workers']:>3} {r['clients']:>7} {r['gen_tokens_per_s']:>9.0f} {r['client_tokens_per_s']:>12.0f} "
            f"{r.get('efficiency', float('nan')):>5.2f} {r['busy_min']:>8.0%} {r['busy_mean']:>9.0%} "
            f"{r['sched_cpu_ms_per_step_p50']:>17.2f} {r['sched_cpu_ms_per_step_p99']:>6.2f} "
            f"{r['sched_cpu_ms_per_step_mean']:>6.2f}  {c['scheduler']:.2f} {c['gateway']:.2f} "
            f"{c.get('redis', 0):.2f} {c['workers']:.2f} {c['client']:.2f}"
            + ("" if r["label"] == "scale" else f"   <- {r['label']} slowdowns {r['slowdowns']}")
        )
    for r in records:
        if r["label"] == "hetero":
            fast = min(range(len(r["slowdowns"])), key=lambda i: r["slowdowns"][i])
            slow = max(range(len(r["slowdowns"])), key=lambda i: r["slowdowns"][i])
            ratio = r["worker_tokens"][fast] / max(1.0, r["worker_tokens"][slow])
            r["fast_slow_token_ratio"] = ratio
            r["slow_token_share"] = r["worker_tokens"][slow] / max(1.0, sum(r["worker_tokens"]))
            lines.append(
                f"heterogeneous (slowdowns {r['slowdowns']}): fast worker busy {r['worker_busy'][fast]:.0%}, "
                f"slow {r['worker_busy'][slow]:.0%}; tokens fast/slow = {ratio:.2f}, "
                f"slow share {r['slow_token_share']:.3f}; mean latency {r['mean_latency_s']:.2f} s"
            )
            alone = [x for x in records if x["label"] == "scale" and x["slowdowns"] == [r["slowdowns"][fast]]]
            if alone:
                r["vs_fast_alone"] = r["gen_tokens_per_s"] / alone[0]["gen_tokens_per_s"]
                lines.append(
                    f"  pair / fast worker alone: gen tok/s x{r['vs_fast_alone']:.2f} "
                    f"(mean latency {alone[0]['mean_latency_s']:.2f} s alone)"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1,2,4 + heterogeneous, short windows (< 3 min)")
    ap.add_argument("--workers", default=None, help="comma-separated N (default 1,2,4,8,16; quick 1,2,4)")
    ap.add_argument("--preset", default="a100-llama2-7b", choices=sorted(PRESETS))
    ap.add_argument("--slowdown", type=float, default=10.0, help="every worker's slowdown (default: 10)")
    ap.add_argument(
        "--hetero", default="1,3", help="relative slowdowns of the heterogeneous pair ('' skips it)"
    )
    ap.add_argument("--clients-per-worker", type=int, default=8)
    ap.add_argument(
        "--clients", type=int, default=None, help="closed-loop clients of every run (overrides per worker)"
    )
    ap.add_argument(
        "--burst",
        type=int,
        default=None,
        help="send this many requests in all per run, no warm-up; tok/s = tokens / (first send to last answer)",
    )
    ap.add_argument("--prompt-mean", type=int, default=256)
    ap.add_argument("--output-mean", type=int, default=64)
    ap.add_argument(
        "--warmup", type=float, default=None, help="seconds before each window (default 5; quick 3)"
    )
    ap.add_argument("--seconds", type=float, default=None, help="measured window (default 20; quick 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--decode-passes", type=int, default=1, help="the scheduler's --decode-passes K (default: 1)"
    )
    ap.add_argument("--migration", default="drain", help="the scheduler's --migration (default: drain)")
    ap.add_argument("--out", default=None, help="JSON lines (default results/scale_out[_quick].jsonl)")
    a = ap.parse_args(argv)
    a.warmup = a.warmup if a.warmup is not None else (3.0 if a.quick else 5.0)
    a.seconds = a.seconds if a.seconds is not None else (10.0 if a.quick else 20.0)
    sizes = [int(n) for n in (a.workers or ("1,2,4" if a.quick else "1,2,4,8,16")).split(",")]
    hetero = [float(f) * a.slowdown for f in a.hetero.split(",")] if a.hetero else []
    stem = Path(a.out or f"benchmarks/results/scale_out{'_quick' if a.quick else ''}.jsonl")
    stem.unlink(missing_ok=True)
    partial = stem.with_suffix(".partial.jsonl")
    partial.unlink(missing_ok=True)

    from tqdm import tqdm

    phases = len(sizes) + (1 if hetero else 0)
    print(
        f"*** SIMULATED workers ({a.preset} x slowdown {a.slowdown:g}); real Redis, scheduler, gateway. ***",
        file=sys.stderr,
    )
    bench = Bench(a)
    records: list[dict] = []
    try:
        bench.start()
        with tqdm(total=phases * (a.warmup + a.seconds), unit="s", bar_format=BAR) as bar:
            bench.bar = bar
            for n in sizes:
                bench.set_workers([a.slowdown] * n)
                records.append(asyncio.run(bench.measure("scale", a.clients or a.clients_per_worker * n)))
                write_jsonl(partial, records[-1])  # kept if a later size fails
            if hetero:
                bench.set_workers(hetero)
                clients = a.clients or a.clients_per_worker * len(hetero)
                records.append(asyncio.run(bench.measure("hetero", clients)))
                write_jsonl(partial, records[-1])
    finally:
        bench.stop()
    efficiency(records)
    lines = report(records)
    machine = {"cpus": os.cpu_count(), "preset": a.preset, "slowdown": a.slowdown}
    for r in records:
        write_jsonl(stem, r | {"config": vars(a) | {"sizes": sizes}, "machine": machine})
    partial.unlink(missing_ok=True)
    png = plot_scale_out(records, stem.with_suffix(".png"))
    print("\n".join(lines))
    print(f"records: {stem}  plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
