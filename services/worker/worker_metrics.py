"""One worker's Prometheus metrics (served on ``--metrics-port``; 0 picks a free port), vLLM's names.

The worker owns what it measures: forward time by pass size, the tokens it sampled, and its KV
cache and device memory, read at scrape time (so a cache freed by an abort reads empty at once,
with no pass needed). Pass sizes as planned belong to the scheduler
(``fuseserve_iteration_tokens_total``). Every series carries ``model_name`` and ``worker``. The
full list with meanings is ``monitoring/README.md``.

Busy fraction over a window = increase of ``fuseserve_forward_time_seconds_sum`` (summed over
``pass_size``) ÷ the window's wall seconds.
"""

from __future__ import annotations

import os
import sys

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PASS_SIZES = (16, 64, 256, 1024, 4096)
"""Upper bounds (tokens) of the ``pass_size`` label's classes; larger passes are ``"4097+"``."""
_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def pass_size_label(num_tokens: int) -> str:
    """The ``pass_size`` class of a pass of ``num_tokens`` tokens: ``"1-16"``, ``"17-64"``, ...,
    ``"4097+"``."""
    low = 1
    for high in PASS_SIZES:
        if num_tokens <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def device_memory_bytes() -> tuple[str, int]:
    """``(device, bytes)`` in use by this process: CUDA's allocated bytes when torch has CUDA up,
    else the process's resident set (a CPU worker's device memory is host memory)."""
    torch = sys.modules.get("torch")  # never import torch here: a simulated worker runs without it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}", int(torch.cuda.memory_allocated())
    with open("/proc/self/statm") as f:
        return "cpu", int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _KVCollector:
    """KV-cache and device-memory gauges and the LoRA adapter loads, read from the runner when
    Prometheus scrapes."""

    def __init__(self, metrics: WorkerMetrics):
        self.m = metrics

    def collect(self):
        labels = ["model_name", "worker"]
        values = [self.m.model_name, self.m.worker_id]
        runner = self.m.runner
        total = int(runner.info.num_blocks) if runner is not None else 0
        used = total - int(runner.num_free_blocks) if runner is not None else 0
        for name, doc, value in (
            (
                "fuseserve_kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1)",
                used / total if total else 0.0,
            ),
            ("fuseserve_kv_cache_blocks_used", "KV-cache blocks held by sequences", used),
            ("fuseserve_kv_cache_blocks_total", "KV-cache blocks on this worker", total),
        ):
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            yield fam
        device, used_bytes = device_memory_bytes()
        fam = GaugeMetricFamily(
            "fuseserve_device_memory_used_bytes",
            "Device memory in use by the worker process (CUDA allocated; CPU: resident set)",
            labels=[*labels, "device"],
        )
        fam.add_metric([*values, device], used_bytes)
        yield fam
        loads = CounterMetricFamily(
            "fuseserve_lora_loads",
            "LoRA adapters written into an adapter slot (a slot's idle adapter evicted once all are "
            "taken); 0 without adapters",
            labels=labels,
        )
        loads.add_metric(values, int(runner.num_lora_loads) if runner is not None else 0)
        yield loads


class WorkerMetrics:
    """The metrics of worker ``worker_id`` serving ``model_name``; ``port`` None: not served,
    0: a free port (then ``self.port``); ``runner`` (``num_free_blocks``, ``info.num_blocks``) is
    read at each scrape."""

    def __init__(self, worker_id: str, model_name: str, port: int | None, runner=None):
        self.worker_id = worker_id
        self.model_name = model_name
        self.runner = runner
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "worker"]
        self._forward = Histogram(
            "fuseserve_forward_time_seconds",
            "Seconds of one forward pass (sampling included), by pass size in tokens",
            [*labels, "pass_size"],
            buckets=_FORWARD_BUCKETS,
            registry=r,
        )
        self.sampled_tokens = Counter(
            "fuseserve_sampled_tokens",
            "Tokens this worker sampled (recomputed ones included; delivered tokens are the "
            "gateway's fuseserve_generation_tokens_total)",
            labels,
            registry=r,
        ).labels(model_name, worker_id)
        self.fenced = Counter(
            "fuseserve_worker_fenced",
            "Plans and frees refused because their scheduler's fencing token was stale (a lease taken over)",
            labels,
            registry=r,
        ).labels(model_name, worker_id)
        self.lora_load = Histogram(
            "fuseserve_lora_load_seconds",
            "Seconds to write one LoRA adapter into an adapter slot (its fuseserve_lora_loads_total)",
            labels,
            buckets=_FORWARD_BUCKETS,
            registry=r,
        ).labels(model_name, worker_id)
        r.register(_KVCollector(self))
        self.port: int | None = None
        if port is not None:
            server, _ = start_http_server(port, registry=r)
            self.port = server.server_port

    def observe_step(self, tokens: int, sampled: int, seconds: float, passes: int = 1) -> None:
        """Record a plan of ``tokens`` tokens that took ``seconds`` and sampled ``sampled`` tokens; a
        multi-pass plan's ``passes`` passes are observed one by one, each ``seconds / passes``."""
        forward = self._forward.labels(self.model_name, self.worker_id, pass_size_label(tokens))
        for _ in range(max(1, passes)):
            forward.observe(seconds / max(1, passes))
        self.sampled_tokens.inc(sampled)

    def observe_lora_loads(self, seconds: list[float]) -> None:
        """Record LoRA slot loads of ``seconds`` each (``Runner.take_lora_load_seconds``)."""
        for s in seconds:
            self.lora_load.observe(s)
