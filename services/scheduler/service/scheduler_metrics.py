"""The scheduler's Prometheus metrics (served on ``--metrics-port``), under vLLM's names.

The scheduler owns what it decides: its queue (``fuseserve_num_requests_waiting``), the sequences
running on its workers, preemptions, prefix-cache lookups and hits (in prompt tokens, vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``), the passes it plans
(``fuseserve_iteration_tokens_total``, one observation per plan, against
``fuseserve_token_budget``), how long planning took, how long a
sequence waited before its first pass, and the workers it drives. With several schedulers each
exports only its own queue and its own workers (a worker is leased by one scheduler), so ``sum()``
over schedulers counts each once. Every series carries ``model_name``, learnt from the first
worker's record (``set_model``). The full list with meanings is ``monitoring/README.md``.
"""

from __future__ import annotations

import json
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from fuseserve import messages
from fuseserve.scheduler.core_stats import SchedulerStats
from fuseserve.types import StepPlan

UNKNOWN_MODEL = "unknown"
_PASS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_PLAN_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
_IDLE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class _Budgets:
    """Collector: ``fuseserve_token_budget{worker}`` read from the scheduler's slots at scrape time
    (a worker that left has no series)."""

    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics

    def collect(self):
        fam = GaugeMetricFamily(
            "fuseserve_token_budget",
            "Configured token budget of one pass on a worker (tokens)",
            labels=["model_name", "worker"],
        )
        scheduler = self.metrics.scheduler
        if scheduler is not None:
            for name, slot in list(scheduler.slots.items()):
                fam.add_metric([self.metrics.model_name, name], slot.token_budget)
        yield fam


class _LoRAInfo:
    """Collector: vLLM's ``lora_requests_info`` as ``fuseserve_lora_requests_info``, read from the
    scheduler at scrape time. Labels: ``running_lora_adapters`` / ``waiting_lora_adapters`` (the
    sorted, comma-joined adapters of the sequences running on its workers / waiting in its queue;
    empty: none) and ``max_lora`` (adapter slots per worker); the value is the epoch time they were
    read (vLLM's convention: the newest sample holds the current labels). One series at a time."""

    def __init__(self, metrics: SchedulerMetrics, max_loras: int):
        self.metrics = metrics
        self.max_loras = max_loras

    def collect(self):
        fam = GaugeMetricFamily(
            "fuseserve_lora_requests_info",
            "LoRA adapters of the running and the waiting sequences (labels); value: epoch seconds read",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        scheduler = self.metrics.scheduler
        if scheduler is not None:
            running = [s for slot in list(scheduler.slots.values()) for s in list(slot.running)]
            labels = [_adapters(running), _adapters(list(scheduler.waiting)), str(self.max_loras)]
            fam.add_metric([self.metrics.model_name, *labels], time.time())
        yield fam


def _adapters(seqs) -> str:
    """The sorted, comma-joined LoRA adapters of ``seqs`` (the base model is none)."""
    return ",".join(sorted({s.lora for s in seqs if s.lora is not None}))


class SchedulerMetrics:
    """The scheduler's metrics; ``port`` (None: not served; 0: a free one, then ``self.port``) starts
    prometheus-client's HTTP server; ``max_loras``: the ``max_lora`` label of
    ``fuseserve_lora_requests_info``.

    ``queue_depth``, ``running``, ``workers`` (gauges), ``preemptions``, ``prefix_cache_queries``,
    ``prefix_cache_hits`` (counters; the last two in prompt tokens), ``cpu_per_step``,
    ``worker_idle`` (histograms, seconds) are children bound to the current ``model_name``.
    """

    def __init__(self, port: int | None, max_loras: int = 1):
        self.registry = r = CollectorRegistry()
        self.model_name = UNKNOWN_MODEL
        self.scheduler = None  # set by ``watch``
        self._arrivals: dict[int, float] = {}  # seq_id → monotonic time it entered the queue
        self._define_counts(r)
        self._define_histograms(r)
        r.register(_Budgets(self))
        r.register(_LoRAInfo(self, max_loras))
        self._families = (
            self._waiting,
            self._running,
            self._workers,
            self._preemptions,
            self._prefix_queries,
            self._prefix_hits,
            self._iteration,
            self._chosen_budget,
            self._plan_seconds,
            self._queue_time,
            self._cpu,
            self._idle,
        )
        self._children: dict[tuple, object] = {}  # (family, worker or None) -> child of model_name
        self._zero_counters()
        self.port: int | None = None
        if port is not None:
            server, _ = start_http_server(port, registry=r)
            self.port = server.server_port

    def _define_counts(self, r: CollectorRegistry) -> None:
        """The gauges and counters, each labelled by ``model_name``."""
        m = ["model_name"]
        self._waiting = Gauge(
            "fuseserve_num_requests_waiting",
            "Sequences waiting for a first pass or after preemption",
            m,
            registry=r,
        )
        self._running = Gauge("fuseserve_num_requests_running", "Sequences running on workers", m, registry=r)
        self._workers = Gauge("fuseserve_num_workers", "Live workers this scheduler drives", m, registry=r)
        self._preemptions = Counter(
            "fuseserve_num_preemptions", "Sequences preempted (recomputed later)", m, registry=r
        )
        self._prefix_queries = Counter(  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
            "fuseserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            m,
            registry=r,
        )
        self._prefix_hits = Counter(
            "fuseserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache at admission (not computed again)",
            m,
            registry=r,
        )

    def _define_histograms(self, r: CollectorRegistry) -> None:
        """The histograms: pass sizes and chosen budgets per worker, planning, queue, CPU and idle time."""
        m = ["model_name"]
        self._iteration = Histogram(
            "fuseserve_iteration_tokens_total",
            "Tokens per planned pass, per worker (compare with fuseserve_token_budget)",
            ["model_name", "worker"],
            buckets=_PASS_BUCKETS,
            registry=r,
        )
        self._plan_seconds = Histogram(
            "fuseserve_plan_build_seconds",
            "Seconds to build the plans of one scheduling round (all workers planned together)",
            m,
            buckets=_PLAN_BUCKETS,
            registry=r,
        )
        self._queue_time = Histogram(
            "fuseserve_request_queue_time_seconds",
            "Seconds a sequence waited in this scheduler before its first pass",
            m,
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self._cpu = Histogram(
            "fuseserve_scheduler_cpu_seconds_per_worker_step",
            "Scheduler process CPU seconds per worker-step (postprocess, plan, gRPC, Redis)",
            m,
            registry=r,
            buckets=(2.5e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05),
        )
        self._idle = Histogram(
            "fuseserve_worker_idle_seconds",
            "Seconds a worker sat idle between passes, as the workers report it",
            m,
            buckets=_IDLE_BUCKETS,
            registry=r,
        )
        self._chosen_budget = Histogram(
            "fuseserve_iteration_token_budget",
            "Token budget chosen for each planned pass, per worker: the fixed budget, or sized from "
            "--target-itl / --target-prefill-rate (compare with fuseserve_iteration_tokens_total)",
            ["model_name", "worker"],
            buckets=_PASS_BUCKETS,
            registry=r,
        )

    # ----- label-bound children (service.py uses these names) -----
    def _child(self, family, worker: str | None = None):
        """``family``'s child for the current model (and ``worker``), looked up once: prometheus'
        ``labels()`` validates and locks on every call, and the observers run for every plan."""
        key = (family, worker)
        child = self._children.get(key)
        if child is None:
            labels = (self.model_name,) if worker is None else (self.model_name, worker)
            child = self._children[key] = family.labels(*labels)
        return child

    @property
    def queue_depth(self):
        return self._child(self._waiting)

    @property
    def running(self):
        return self._child(self._running)

    @property
    def workers(self):
        return self._child(self._workers)

    @property
    def preemptions(self):
        return self._child(self._preemptions)

    @property
    def prefix_cache_queries(self):
        return self._child(self._prefix_queries)

    @property
    def prefix_cache_hits(self):
        return self._child(self._prefix_hits)

    @property
    def cpu_per_step(self):
        return self._child(self._cpu)

    @property
    def worker_idle(self):
        return self._child(self._idle)

    def set_model(self, model_name: str) -> None:
        """Label every series with ``model_name`` from now on. The series of the previous name are
        dropped (before the first worker nothing ran: only gauges, which are set again)."""
        if model_name == self.model_name:
            return
        for fam in self._families:
            fam.clear()
        self._children.clear()
        self.model_name = model_name
        self._zero_counters()

    def _zero_counters(self) -> None:
        """Create the counters' series at 0, so they are exported (and rate() works) before the
        first preemption or prefix lookup."""
        for counter in (self.preemptions, self.prefix_cache_queries, self.prefix_cache_hits):
            counter.inc(0)

    def watch(self, core) -> None:
        """Observe the passes ``core`` (an ``EngineCore``) plans, and read its workers' budgets."""
        self.scheduler = core.scheduler
        core.on_plans = self.observe_plans
        core.scheduler.pass_observers.append(self.observe_budget)

    def record(self, stats: SchedulerStats) -> None:
        """Count the events of one stats record (``EngineCore.make_stats``, read and reset: each
        event comes in one record): preemptions, prefix-cache lookups and hits, worker idle times."""
        new = stats.new
        if new.num_preemptions:
            self.preemptions.inc(new.num_preemptions)
        if new.num_prefix_queries:
            self.prefix_cache_queries.inc(new.num_prefix_queries)
            self.prefix_cache_hits.inc(new.num_prefix_hits)
        for idle in stats.new_idle_s:
            self.worker_idle.observe(idle)

    def observe_budget(self, worker: str, token_budget: int, num_tokens: int) -> None:
        """The budget chosen for one planned pass (``Scheduler.pass_observers``). A plan that only
        frees blocks (``num_tokens`` 0) is not a pass: ``fuseserve_iteration_tokens_total`` skips it
        too, so the two histograms count the same passes and their ``_sum`` ratio is pass fullness."""
        if num_tokens:
            self._child(self._chosen_budget, worker).observe(token_budget)

    def note_arrival(self, seq_id: int) -> None:
        """A sequence entered the queue now (not for one taken over from a dead scheduler: its
        queue time, if any, was observed there)."""
        self._arrivals[seq_id] = time.monotonic()

    def forget(self, seq_id: int) -> None:
        """A sequence finished (an abort while waiting included): drop its arrival time."""
        self._arrivals.pop(seq_id, None)

    def observe_plans(self, plans: dict[str, StepPlan], seconds: float) -> None:
        """One scheduling round: ``plans`` (worker → plan) built in ``seconds``."""
        now = time.monotonic()
        self._child(self._plan_seconds).observe(seconds)
        arrivals = self._arrivals
        for worker, plan in plans.items():
            if plan.chunks:
                self._child(self._iteration, worker).observe(plan.num_tokens)
            if not arrivals:
                continue
            for chunk in plan.chunks:
                arrival = arrivals.pop(chunk.seq_id, None)
                if arrival is not None:
                    self._child(self._queue_time).observe(now - arrival)

    def drop_worker(self, worker: str) -> None:
        """Forget a departed worker's pass histogram (its history stays in Prometheus)."""
        for fam in (self._iteration, self._chosen_budget):
            self._children.pop((fam, worker), None)
            try:
                fam.remove(self.model_name, worker)
            except KeyError:
                pass


def stats_command(service) -> tuple:
    """The ``SET`` of ``service``'s stats record (``messages.scheduler_stats_key``: its queue, its
    workers, CPU per worker-step, worker idle times, takeovers and hand-overs, its Prometheus
    endpoint; readers add the schedulers' records up, ``messages.read_scheduler_stats``), for a
    ``SchedulerService``; sets its queue-depth and running gauges."""
    record = service.core.make_stats()
    service.metrics.record(record)
    totals = service.scheduler.totals()
    waiting, running = record.num_waiting, record.num_running
    workers = {
        name: {
            "admitted": w.num_admitted,
            "running": w.num_running,
            "free_blocks": w.num_free_blocks,
            "num_blocks": w.num_blocks,
        }
        for name, w in record.workers.items()
    }
    cpu50, cpu99 = service.core.stats.cpu_per_step_ms()
    idle50, idle99 = service.core.stats.idle_ms()
    slots = list(service.scheduler.slots.values())
    in_use = [s for slot in slots for s in slot.running] + list(service.scheduler.waiting)
    served = [a for slot in slots for a in slot.lora_adapters or ()]
    stats = {
        "waiting": waiting,
        "running": running,
        "time": time.time(),
        "workers": workers,
        "worker_steps": record.num_worker_steps,
        "cpu_ms_per_worker_step": {"p50": cpu50, "p99": cpu99},
        "worker_idle_ms": {"p50": idle50, "p99": idle99},
        "surplus_tokens": record.num_surplus_tokens,
        "scheduler": service.consumer,
        "pid": os.getpid(),
        "taken_over": service.num_taken_over,
        "migrated": totals.num_migrated,
        "migrated_bytes": totals.num_migrated_bytes,
        "rebalanced": totals.num_rebalanced,
        "recomputed_tokens": totals.num_recomputed_tokens,
        "migration_seconds": totals.migration_seconds,
        "lost_to_peers": service.num_lost_to_peers,
        "handed_over": service.num_handed_over,
        "fenced_workers": service.leases.num_fenced,
        "metrics_port": service.metrics.port,
        "metrics_host": service.advertise_host,
        "lora_in_use": sorted({s.lora for s in in_use if s.lora is not None}),  # running or waiting
        "lora_served": sorted(set(served)) if slots else None,  # adapters its workers advertise
    }
    service.metrics.queue_depth.set(waiting)  # the gauges; ``record`` counted the events
    service.metrics.running.set(running)
    # its own record: readers add the schedulers' records up (``messages.read_scheduler_stats``)
    return ("SET", messages.scheduler_stats_key(service.consumer), json.dumps(stats), "EX", 10)
