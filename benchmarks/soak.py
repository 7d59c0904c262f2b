"""Soak: a local stack under steady load for ``--minutes`` (default 10), disturbed on purpose.

The stack is the one ``fuseserve serve`` starts (``fuseserve.launcher.start_stack``): Redis,
scheduler, gateway and ``--workers`` workers, simulated by default (``--simulate PRESET``; the real
CPU model with ``--simulate none``). ``--clients`` closed-loop clients send streamed completions
(prompt and output lengths drawn at random); each request is abandoned mid-stream with probability
``--disconnect`` (the client closes the connection after a random number of tokens). During the run:

- at 25% of it, worker-1 is killed (SIGKILL) and, 10 s later, restarted by the stack's supervisor;
- at 60%, Redis is stopped and started again on the same port (empty: nothing is persisted).

Reported: requests served (finished), abandoned on purpose, errors by kind (HTTP status, an error
event inside a stream, or the client exception's class), and at the start and the end (after the
load stopped and ``--settle`` seconds passed): the RSS of every process of the stack, KV blocks in
use on every worker, requests in flight at the gateway and sequences waiting/running in the
scheduler, all read from their /metrics (``fuseserve.top``). The end must return to the start:
KV 0, nothing in flight. Not a test: ``python -m benchmarks.soak [--minutes N]`` prints a Markdown
report and writes it to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx

from fuseserve.cli import serve_args
from fuseserve.launcher import start_stack
from fuseserve.redis_launcher import _ping, free_port
from fuseserve.top import discover, scrape, total

MODEL = "smollm2-135m-instruct"
WORDS = "the of a river runs past old stone towers while distant bells ring over quiet fields".split()


def rss_mib(pid: int) -> float | None:
    """Resident set of ``pid`` in MiB (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def observe(stack, base: str) -> dict:
    """RSS of every process, KV blocks in use per worker, gateway in-flight and scheduler queue."""
    procs = {name: p.pid for name, p in stack.procs if p.poll() is None}
    procs["redis"] = stack.redis.process.pid
    schedulers, workers = discover(stack.redis.url)
    with httpx.Client(timeout=5) as client:
        snap = scrape(client, base, schedulers, workers)
    kv = {}
    for series in snap.workers.values():
        for (name, labels), value in series.items():
            if name == "fuseserve_kv_cache_blocks_used":
                kv[dict(labels)["worker"]] = value
    sched = list(snap.schedulers.values())
    return {
        "rss_mib": {name: rss_mib(pid) for name, pid in sorted(procs.items())},
        "kv_blocks_used": dict(sorted(kv.items())),
        "in_flight": total(snap.gateway, "fuseserve_num_requests_in_flight"),
        "waiting": sum(total(s, "fuseserve_num_requests_waiting") for s in sched),
        "running": sum(total(s, "fuseserve_num_requests_running") for s in sched),
        "scrape_errors": snap.errors,
    }


class Load:
    """Closed-loop streaming clients; counts outcomes by kind."""

    def __init__(self, base: str, disconnect: float, seed: int):
        self.base = base
        self.disconnect = disconnect
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.tokens = 0
        self.stop = False

    async def one(self, client: httpx.AsyncClient) -> str:
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(4, 200)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.rng.randint(8, 128), "stream": True}
        leave_after = self.rng.randint(1, 16) if self.rng.random() < self.disconnect else None
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"http {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"stream error {chunk['error'].get('status')} {chunk['error'].get('type')}"
                seen += 1
                self.tokens += 1
                if leave_after is not None and seen >= leave_after:
                    return "disconnected (on purpose)"
        return "ok"

    async def client(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=120) as client:
            while not self.stop:
                try:
                    kind = await self.one(client)
                except httpx.HTTPError as e:
                    kind = f"client {type(e).__name__}"
                self.outcomes[kind] += 1
                if kind != "ok" and kind.startswith(("http", "client")):
                    await asyncio.sleep(0.5)  # a refused client backs off, as a real one would


def restart_redis(stack) -> float:
    """Stop Redis and start it again with the same command line (same port); seconds it was down."""
    old = stack.redis.process
    down = time.monotonic()
    old.terminate()
    old.wait(10)
    stack.redis.process = subprocess.Popen(
        old.args,
        cwd=stack.redis._workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    while not _ping(stack.redis.url):
        time.sleep(0.05)
    return time.monotonic() - down


async def soak(args: argparse.Namespace) -> dict:
    simulate = None if args.simulate == "none" else args.simulate
    options = (
        {"simulate": simulate, "simulate_slowdown": str(args.slowdown)} if simulate else {"device": "cpu"}
    )
    stack, base = start_stack(serve_args(model=MODEL, workers=args.workers, port=free_port(), **options))
    events: list[str] = []
    try:
        start = observe(stack, base)
        load = Load(base, args.disconnect, args.seed)
        tasks = [asyncio.create_task(load.client()) for _ in range(args.clients)]
        t0 = time.monotonic()
        duration = args.minutes * 60
        plan = [
            (0.25 * duration, "kill worker"),
            (0.25 * duration + 10, "restart worker"),
            (0.6 * duration, "redis"),
        ]
        while time.monotonic() - t0 < duration:
            elapsed = time.monotonic() - t0
            if plan and elapsed >= plan[0][0]:
                _, what = plan.pop(0)
                if what == "kill worker":
                    proc = dict(stack.procs)["worker-1"]
                    proc.send_signal(signal.SIGKILL)
                    events.append(f"{elapsed:.0f} s: worker-1 (pid {proc.pid}) killed")
                elif what == "restart worker":
                    stack.supervise()  # respawns the exited worker
                    events.append(f"{elapsed:.0f} s: worker-1 restarted by the supervisor")
                else:
                    down = await asyncio.to_thread(restart_redis, stack)
                    events.append(f"{elapsed:.0f} s: Redis restarted (down {down:.2f} s, came back empty)")
            await asyncio.sleep(0.5)
        load.stop = True
        await asyncio.wait(tasks, timeout=130)
        await asyncio.sleep(args.settle)
        end = observe(stack, base)
    finally:
        stack.stop()
    served = load.outcomes["ok"]
    return {
        "minutes": args.minutes,
        "workers": args.workers,
        "clients": args.clients,
        "simulate": simulate,
        "slowdown": args.slowdown if simulate else None,
        "served": served,
        "disconnected_on_purpose": load.outcomes["disconnected (on purpose)"],
        "errors": {
            k: v for k, v in sorted(load.outcomes.items()) if k not in ("ok", "disconnected (on purpose)")
        },
        "stream_chunks": load.tokens,
        "events": events,
        "start": start,
        "end": end,
    }


def report(r: dict) -> str:
    """The Markdown report of a soak result."""
    mode = f"simulated {r['simulate']} x{r['slowdown']:g}" if r["simulate"] else "CPU SmolLM2"
    lines = [
        f"Soak: {r['minutes']:g} min, {r['workers']} workers ({mode}), {r['clients']} streaming clients",
        "",
        f"- requests served: {r['served']}; abandoned mid-stream on purpose: {r['disconnected_on_purpose']}",
        f"- errors by kind: {r['errors'] or 'none'}",
        *(f"- {e}" for e in r["events"]),
        "",
        "| | start | end |",
        "|---|---|---|",
    ]
    s, e = r["start"], r["end"]
    for name in sorted(set(s["rss_mib"]) | set(e["rss_mib"])):
        a, b = s["rss_mib"].get(name), e["rss_mib"].get(name)
        fmt = lambda x: "-" if x is None else f"{x:.0f} MiB"  # noqa: E731
        lines.append(f"| RSS {name} | {fmt(a)} | {fmt(b)} |")
    lines.append(f"| KV blocks used | {s['kv_blocks_used']} | {e['kv_blocks_used']} |")
    for key in ("in_flight", "waiting", "running"):
        lines.append(f"| {key.replace('_', ' ')} | {s[key]:.0f} | {e[key]:.0f} |")
    if e["scrape_errors"]:
        lines.append(f"\nunreachable at the end: {e['scrape_errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="load duration (default: 10)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--simulate", default="a100-llama2-7b", help="latency preset, or none for the CPU model")
    ap.add_argument("--slowdown", type=float, default=10.0, help="simulated workers' slowdown (default: 10)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="chance a client leaves mid-stream")
    ap.add_argument(
        "--settle", type=float, default=5.0, help="seconds between the load's end and the end reading"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON result (default benchmarks/results/soak.json)")
    args = ap.parse_args(argv)
    result = asyncio.run(soak(args))
    out = Path(args.out or Path(__file__).parent / "results" / "soak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
