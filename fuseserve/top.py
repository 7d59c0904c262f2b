"""``fuseserve top``: a live terminal view of a running stack, read from the services' /metrics.

It scrapes the gateway (``--url``), and, found through Redis (``--redis-url``), every scheduler
(``metrics_port`` in its stats) and worker (``metrics_port`` in its record), or the endpoints given
with ``--target``. Two scrapes ``--interval`` seconds apart give the rates and the percentiles of
that interval (Prometheus' ``histogram_quantile`` interpolation); ``--once`` prints one frame and
exits. The metric names are the ones in ``monitoring/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:  # imported when `top` runs: the CLI that registers it runs in images without them
    import httpx

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""(sample name, sorted labels) → value."""


def parse(text: str) -> Series:
    """The samples of a Prometheus text exposition."""
    out: Series = {}
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(series: Series, name: str, **match: str) -> float:
    """Sum of ``name``'s samples whose labels include ``match``."""
    return sum(v for (n, labels), v in series.items() if n == name and match.items() <= dict(labels).items())


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``{upper bound: count}`` (``inf`` included), interpolated
    linearly inside the bucket as Prometheus does; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return lower
            inside = buckets[b] - below
            return lower + (b - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = b, buckets[b]
    return lower


def bucket_delta(cur: Series, prev: Series, name: str, **match: str) -> dict[float, float]:
    """``name``'s cumulative buckets, increase between two scrapes (the whole history when ``prev``
    has none), summed over other labels."""
    out: dict[float, float] = defaultdict(float)
    for series, sign in ((cur, 1.0), (prev, -1.0)):
        for (n, labels), v in series.items():
            d = dict(labels)
            if n == name + "_bucket" and match.items() <= d.items():
                out[float(d["le"])] += sign * v
    return dict(out)


@dataclass
class Snapshot:
    """One scrape of every endpoint: ``gateway``, ``schedulers`` and ``workers`` (url → series)."""

    taken_at: float
    gateway: Series = field(default_factory=dict)
    schedulers: dict[str, Series] = field(default_factory=dict)
    workers: dict[str, Series] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def discover(redis_url: str) -> tuple[list[str], list[str]]:
    """``(scheduler urls, worker urls)`` of the metrics endpoints registered in Redis."""
    import redis

    from fuseserve import messages
    from fuseserve.redis_launcher import with_password

    r = redis.Redis.from_url(with_password(redis_url), decode_responses=True)
    workers, schedulers = [], []
    for key in r.scan_iter(match=f"{messages.WORKER_PREFIX}*", count=100):
        raw = r.get(key)
        if raw:
            rec = messages.WorkerRecord.decode(raw)
            if rec.metrics_port:
                workers.append(f"http://{rec.address.rsplit(':', 1)[0]}:{rec.metrics_port}/metrics")
    for key in r.scan_iter(match=messages.scheduler_stats_key("*"), count=100):
        raw = r.get(key)
        stats = json.loads(raw) if raw else {}
        if stats.get("metrics_port"):
            host = stats.get("metrics_host") or urlparse(redis_url).hostname or "127.0.0.1"
            schedulers.append(f"http://{host}:{stats['metrics_port']}/metrics")
    r.close()
    return sorted(schedulers), sorted(workers)


def scrape(client: httpx.Client, gateway: str, schedulers: list[str], workers: list[str]) -> Snapshot:
    """Read every endpoint once; one that fails is listed in ``errors`` and left out."""
    import httpx

    snap = Snapshot(time.monotonic())

    def get(url: str) -> Series:
        try:
            return parse(client.get(url).text)
        except (httpx.HTTPError, ValueError) as e:
            snap.errors.append(f"{url}: {e}")
            return {}

    snap.gateway = get(gateway.rstrip("/") + "/metrics")
    snap.schedulers = {u: get(u) for u in schedulers}
    snap.workers = {u: get(u) for u in workers}
    return snap


def frame(prev: Snapshot, cur: Snapshot) -> dict:
    """The numbers ``fuseserve top`` shows, from two snapshots (rates over their interval).

    Returns ``{"gateway": {...}, "scheduler": {...}, "workers": [{...}], "errors": [...]}``;
    latencies in seconds (None: no token in the interval), rates per second, KV as a fraction.
    """
    dt = max(cur.taken_at - prev.taken_at, 1e-9)
    workers = [
        _worker_frame(url, w, prev.workers.get(url, {}), dt) for url, w in sorted(cur.workers.items()) if w
    ]
    return {
        "gateway": _gateway_frame(prev.gateway, cur.gateway, dt),
        "scheduler": _scheduler_frame(prev, cur),
        "workers": workers,
        "errors": cur.errors,
    }


def _gateway_frame(pg: Series, g: Series, dt: float) -> dict:
    """The gateway's row: requests in flight, rates per second over ``dt`` seconds, p95 latencies."""

    def rate(name: str, **match: str) -> float:
        return max(0.0, total(g, name, **match) - total(pg, name, **match)) / dt

    def p95(name: str) -> float | None:
        return histogram_quantile(0.95, bucket_delta(g, pg, name))

    return {
        "in_flight": total(g, "fuseserve_num_requests_in_flight"),
        "requests_per_s": rate("fuseserve_http_requests_total"),
        "tokens_per_s": rate("fuseserve_generation_tokens_total"),
        "ttft_p95": p95("fuseserve_time_to_first_token_seconds"),
        "itl_p95": p95("fuseserve_inter_token_latency_seconds"),
        "e2e_p95": p95("fuseserve_e2e_request_latency_seconds"),
        "aborts": total(g, "fuseserve_request_success_total", finished_reason="abort"),
        "errors": total(g, "fuseserve_request_success_total", finished_reason="error"),
    }


def _scheduler_frame(prev: Snapshot, cur: Snapshot) -> dict:
    """The schedulers' row, summed over those that answered: queues, workers, preemptions, and how
    full the interval's passes were: their tokens over the budgets chosen for the same passes, both
    summed over every scheduler and worker (a ratio of sums, as the dashboard's; None: no pass)."""
    sched = [s for s in cur.schedulers.values() if s]
    prev_sched = [s for s in prev.schedulers.values() if s]

    def increase(name: str) -> float:
        return sum(total(s, name) for s in sched) - sum(total(s, name) for s in prev_sched)

    tokens = increase("fuseserve_iteration_tokens_total_sum")
    budgets = increase("fuseserve_iteration_token_budget_sum")
    return {
        "schedulers": len(sched),
        "waiting": sum(total(s, "fuseserve_num_requests_waiting") for s in sched),
        "running": sum(total(s, "fuseserve_num_requests_running") for s in sched),
        "workers": sum(total(s, "fuseserve_num_workers") for s in sched),
        "preemptions": sum(total(s, "fuseserve_num_preemptions_total") for s in sched),
        "pass_fullness": tokens / budgets if budgets > 0 else None,
    }


def _worker_frame(url: str, w: Series, pw: Series, dt: float) -> dict:
    """One worker's row (named by its ``worker`` label, else its URL): KV use, passes per second and
    the fraction of ``dt`` spent in forward passes, device memory in bytes."""
    name = next((dict(lb).get("worker") for (n, lb) in w if n == "fuseserve_kv_cache_blocks_total"), url)
    busy = total(w, "fuseserve_forward_time_seconds_sum") - total(pw, "fuseserve_forward_time_seconds_sum")
    passes = total(w, "fuseserve_forward_time_seconds_count") - total(
        pw, "fuseserve_forward_time_seconds_count"
    )
    return {
        "worker": name,
        "kv_usage": total(w, "fuseserve_kv_cache_usage_perc"),
        "blocks_used": int(total(w, "fuseserve_kv_cache_blocks_used")),
        "blocks_total": int(total(w, "fuseserve_kv_cache_blocks_total")),
        "passes_per_s": max(0.0, passes) / dt,
        "busy": max(0.0, busy) / dt,
        "memory_bytes": total(w, "fuseserve_device_memory_used_bytes"),
    }


def render(f: dict):
    """A ``rich`` renderable of one frame."""
    from rich.console import Group
    from rich.table import Table

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f} ms"

    gw, sc = f["gateway"], f["scheduler"]
    head = Table(title="fuseserve", show_header=True, expand=False)
    for col in ("in flight", "waiting", "running", "req/s", "tok/s", "TTFT p95", "ITL p95", "e2e p95"):
        head.add_column(col, justify="right")
    head.add_row(
        f"{gw['in_flight']:.0f}",
        f"{sc['waiting']:.0f}",
        f"{sc['running']:.0f}",
        f"{gw['requests_per_s']:.1f}",
        f"{gw['tokens_per_s']:.1f}",
        ms(gw["ttft_p95"]),
        ms(gw["itl_p95"]),
        ms(gw["e2e_p95"]),
    )
    fullness = "-" if sc["pass_fullness"] is None else f"{100 * sc['pass_fullness']:.0f}%"
    info = (
        f"schedulers {sc['schedulers']}  live workers {sc['workers']:.0f}  pass fullness {fullness}  "
        f"preemptions {sc['preemptions']:.0f}  aborts {gw['aborts']:.0f}  errors {gw['errors']:.0f}"
    )
    wt = Table(show_header=True)
    for col in ("worker", "KV use", "blocks", "passes/s", "busy", "memory"):
        wt.add_column(col, justify="right")
    for w in f["workers"]:
        wt.add_row(
            str(w["worker"]),
            f"{100 * w['kv_usage']:.1f}%",
            f"{w['blocks_used']}/{w['blocks_total']}",
            f"{w['passes_per_s']:.1f}",
            f"{100 * w['busy']:.0f}%",
            f"{w['memory_bytes'] / 2**20:.0f} MiB",
        )
    return Group(head, info, wt, *(f"[red]unreachable: {e}[/red]" for e in f["errors"]))


def run_top(args: argparse.Namespace) -> int:
    """``fuseserve top``: refresh every ``args.interval`` seconds until Ctrl-C (``--once``: one frame,
    printed after two scrapes ``interval`` apart; ``--json``: that frame as JSON). Returns 0, or 1
    when the gateway cannot be scraped."""
    try:
        import httpx
        from rich.console import Console
        from rich.live import Live
    except ImportError as exc:
        print(f"fuseserve top needs httpx and rich: pip install httpx rich ({exc})", file=sys.stderr)
        return 2

    schedulers, workers = list(args.scheduler or []), list(args.worker or [])

    def endpoints():
        if args.redis_url:
            found = discover(args.redis_url)
            return schedulers or found[0], workers or found[1]
        return schedulers, workers

    with httpx.Client(timeout=5.0) as client:
        prev = scrape(client, args.url, *endpoints())
        if not prev.gateway:
            Console(stderr=True).print(f"cannot read {args.url}/metrics: {'; '.join(prev.errors)}")
            return 1
        if args.once:
            time.sleep(args.interval)
            f = frame(prev, scrape(client, args.url, *endpoints()))
            print(json.dumps(f)) if args.json else Console().print(render(f))
            return 0
        try:
            with Live(auto_refresh=False) as live:
                while True:
                    time.sleep(args.interval)
                    cur = scrape(client, args.url, *endpoints())
                    live.update(render(frame(prev, cur)), refresh=True)
                    prev = cur
        except KeyboardInterrupt:
            return 0


def add_parser(sub) -> None:
    """Register ``fuseserve top``."""
    t = sub.add_parser(
        "top", help="live terminal view of a running stack (workers, KV, queue, tokens/s, p95s)"
    )
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    t.add_argument(
        "--redis-url",
        default=None,
        help="find schedulers' and workers' metrics endpoints here (password: $FUSESERVE_REDIS_PASSWORD or in the URL)",
    )
    t.add_argument("--scheduler", action="append", help="a scheduler's metrics URL (repeatable)")
    t.add_argument("--worker", action="append", help="a worker's metrics URL (repeatable)")
    t.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    t.add_argument(
        "--once", action="store_true", help="print one frame (two scrapes --interval apart) and exit"
    )
    t.add_argument("--json", action="store_true", help="with --once: the frame as JSON")
    t.set_defaults(func=run_top)
