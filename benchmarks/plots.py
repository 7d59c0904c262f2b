"""Benchmark plots (matplotlib, Agg backend, PNG), from `benchmarks.metrics.summarize` records.

Each record is a dict holding the `summarize` keys plus ``clients`` (number of closed-loop clients)
and ``system`` and/or ``policy`` (what was measured); one line is drawn per system/policy label.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Record = Mapping[str, Any]


def label_of(record: Record) -> str:
    """``"system/policy"``, or whichever of the two is present (``"?"`` when neither)."""
    parts = [str(record[k]) for k in ("system", "policy") if record.get(k) is not None]
    return "/".join(parts) or "?"


def _by_label(results: Sequence[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in results:
        groups[label_of(r)].append(r)
    return {k: sorted(v, key=lambda r: r["clients"]) for k, v in groups.items()}


def _num(value: Any) -> float:
    """A plotted value; None (a NaN written to JSON as null) becomes NaN, i.e. a gap in the line."""
    return float("nan") if value is None else float(value)


def _clients_axis(ax: Any, results: Sequence[Record]) -> None:
    """Log-2 x axis with one plain-integer tick per measured client count."""
    clients = sorted({int(r["clients"]) for r in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.minorticks_off()
    ax.set_xlabel("clients")


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput_latency(
    results: Sequence[Record],
    path: str | Path,
    throughput_key: str = "requests_per_s",
    latency_key: str = "mean_e2e_latency_s",
) -> Path:
    """Throughput (y) against mean end-to-end latency (x), one line per system, points = clients.

    The paper's Figure 5 layout. Returns the PNG path.
    """
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, rows in _by_label(results).items():
        xs = [_num(r[latency_key]) for r in rows]
        ys = [_num(r[throughput_key]) for r in rows]
        ax.plot(xs, ys, marker="o", label=label)
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(str(r["clients"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(latency_key.replace("_", " "))
    ax.set_ylabel(throughput_key.replace("_", " "))
    ax.set_title("Throughput vs latency (labels: clients)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_effective_throughput(
    results: Sequence[Record], path: str | Path, key: str = "effective_requests_per_s"
) -> Path:
    """Effective throughput against clients: one panel per token-rate threshold, one line per system.

    ``key`` is a `summarize` dict keyed by threshold (``effective_requests_per_s`` or
    ``effective_tokens_per_s``). Panel titles give the (scaled) thresholds. Returns the PNG path.
    """
    rates = sorted({k for r in results for k in r.get(key, {})}, key=float)
    fig, axes = plt.subplots(1, max(1, len(rates)), figsize=(4.5 * max(1, len(rates)), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=False):
        for label, rows in _by_label(results).items():
            pts = [(r["clients"], _num(r[key][rate])) for r in rows if rate in r.get(key, {})]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        prompt_rate = next((r["sla"]["prompt_rate"] for r in results if "sla" in r), None)
        title = f"token rate >= {rate}/s"
        if prompt_rate is not None:
            title += f", prompt {prompt_rate:g} tok/s"
        ax.set_title(title, fontsize=9)
        _clients_axis(ax, results)
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_token_latency(results: Sequence[Record], path: str | Path) -> Path:
    """Per-token latency P50 / P90 / P95 (s) against clients: one panel per percentile."""
    keys = ("token_latency_p50_s", "token_latency_p90_s", "token_latency_p95_s")
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, rows in _by_label(results).items():
            ax.plot([r["clients"] for r in rows], [_num(r[key]) for r in rows], marker="o", label=label)
        ax.set_title(key.replace("_", " "))
        _clients_axis(ax, results)
        ax.set_ylabel("seconds")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_scale_out(records: Sequence[Record], path: str | Path) -> Path:
    """``benchmarks.scale_out`` records: tokens/s with the ideal line, efficiency and busy fraction,
    and scheduler CPU per worker-step (p50 / p99), against the number of simulated workers."""
    scale = sorted((r for r in records if r.get("label") == "scale"), key=lambda r: r["workers"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if not scale:
        return _save(fig, path)
    ns = [int(r["workers"]) for r in scale]
    tput = [_num(r["gen_tokens_per_s"]) for r in scale]
    one = next((t for n, t in zip(ns, tput, strict=True) if n == 1), float("nan"))
    ax = axes[0]
    ax.plot(ns, tput, "o-", label="measured")
    ax.plot(ns, [n * one for n in ns], "k--", lw=1, label="ideal (N x one worker)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("throughput")
    ax.legend()
    ax = axes[1]
    ax.plot(ns, [_num(r.get("efficiency")) for r in scale], "o-", label="scaling efficiency")
    ax.plot(ns, [_num(r["busy_mean"]) for r in scale], "s-", label="worker busy, mean")
    ax.plot(ns, [_num(r["busy_min"]) for r in scale], "v-", label="worker busy, min")
    ax.axhline(0.9, color="k", ls=":", lw=1)
    ax.set_ylim(0, 1.05)
    ax.set_title("efficiency and busy fraction")
    ax.legend(loc="lower left")
    for r in records:
        if r.get("label") == "hetero" and r.get("fast_slow_token_ratio") is not None:
            order = sorted(range(len(r["slowdowns"])), key=lambda i: r["slowdowns"][i])
            busy = "/".join(f"{r['worker_busy'][i]:.0%}" for i in order)
            factors = ":".join(f"{r['slowdowns'][i]:g}" for i in order)
            ax.text(
                0.98,
                0.98,
                f"heterogeneous, slowdowns {factors}: busy {busy},\n"
                f"tokens fast/slow {r['fast_slow_token_ratio']:.2f}",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
            )
    ax = axes[2]
    ax.plot(ns, [_num(r["sched_cpu_ms_per_step_p50"]) for r in scale], "o-", label="p50 (1-s intervals)")
    ax.plot(ns, [_num(r["sched_cpu_ms_per_step_p99"]) for r in scale], "s-", label="p99 (1-s intervals)")
    ax.axhline(0.3, color="k", ls=":", lw=1, label="target 0.3 ms")
    ax.set_ylabel("scheduler CPU ms per worker-step")
    ax.set_title("scheduler cost")
    ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("simulated workers")
        ax.grid(alpha=0.3)
    return _save(fig, path)
