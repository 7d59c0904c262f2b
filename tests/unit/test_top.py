"""``fuseserve top``'s arithmetic on scrapes of the real metric registries (no stack)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from fuseserve.gateway.gateway_metrics import GatewayMetrics
from fuseserve.top import Snapshot, frame, histogram_quantile, parse
from fuseserve.worker.worker_metrics import WorkerMetrics


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 0.0, 0.2: 50.0, 0.4: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.95, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # past the last bound


def test_frame_rates_and_percentiles_over_the_interval():
    gw = GatewayMetrics("m")
    runner = SimpleNamespace(info=SimpleNamespace(num_blocks=10), num_free_blocks=10)
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
