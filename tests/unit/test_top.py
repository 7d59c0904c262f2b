"""``fuseserve top``'s arithmetic on scrapes of the real metric registries (no stack)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from fuseserve.gateway.gateway_metrics import GatewayMetrics
from fuseserve.scheduler.service.scheduler_metrics import SchedulerMetrics
from fuseserve.top import Snapshot, frame, histogram_quantile, parse
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.worker_metrics import WorkerMetrics


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 0.0, 0.2: 50.0, 0.4: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.95, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # past the last bound


def test_frame_rates_and_percentiles_over_the_interval():
    gw = GatewayMetrics("m")
    runner = SimpleNamespace(info=SimpleNamespace(num_blocks=10), num_free_blocks=10, num_lora_loads=0)
    worker = WorkerMetrics("w0", "m", None, runner)

    def snap(t: float) -> Snapshot:
        return Snapshot(
            t,
            parse(generate_latest(gw.registry).decode()),
            {},
            {"w": parse(generate_latest(worker.registry).decode())},
        )

    gw.ttft.observe(30.0)  # before the interval: not in its p95
    before = snap(0.0)
    for _ in range(20):
        gw.ttft.observe(0.04)
    gw.generation_tokens.inc(100)
    worker.observe_step(64, 4, 0.5)
    runner.num_free_blocks = 4
    f = frame(before, snap(2.0))
    assert f["gateway"]["tokens_per_s"] == 50.0
    assert 0.025 < f["gateway"]["ttft_p95"] <= 0.05
    (w,) = f["workers"]
    assert w["worker"] == "w0" and w["kv_usage"] == 0.6 and (w["blocks_used"], w["blocks_total"]) == (6, 10)
    assert w["busy"] == 0.25 and w["passes_per_s"] == 0.5


def test_schedulers_summed_and_pass_fullness_a_ratio_of_sums():
    """Two schedulers: queues and workers add up; pass fullness is every pass's tokens over every
    pass's budget (a: 3 full passes of 100 at budget 100, b: one pass of 100 at budget 1000 →
    400 / 1300), not the mean pass over the mean budget (100 / 550)."""
    schedulers = {}
    for name, budget, waiting in (("a", 100, 2), ("b", 1000, 5)):
        m = SchedulerMetrics(None)
        slots = {f"w-{name}": SimpleNamespace(token_budget=budget, running=[])}
        m.set_model("m")
        scheduler = SimpleNamespace(slots=slots, waiting=[], pass_observers=[])
        m.watch(SimpleNamespace(scheduler=scheduler, on_plans=None))
        m.queue_depth.set(waiting)
        m.workers.set(1)
        schedulers[name] = m

    def snap(t: float) -> Snapshot:
        scraped = {n: parse(generate_latest(m.registry).decode()) for n, m in schedulers.items()}
        return Snapshot(t, {}, scraped, {})

    before = snap(0.0)
    for name, budget, passes in (("a", 100, 3), ("b", 1000, 1)):
        m = schedulers[name]
        for i in range(passes):
            m.observe_plans(
                {f"w-{name}": StepPlan(i, [SeqChunk(1, 100 * i, 100, list(range(100)), True)])}, 0.001
            )
            m.observe_budget(f"w-{name}", budget, 100)
    f = frame(before, snap(1.0))
    sc = f["scheduler"]
    assert (sc["schedulers"], sc["waiting"], sc["workers"]) == (2, 7, 2)
    assert sc["pass_fullness"] == pytest.approx(400 / 1300)
