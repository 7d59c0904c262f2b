"""What a worker reports of its LoRA adapters: the names it serves in its Redis record
(``messages.WorkerRecord.lora_adapters``, read by the scheduler's leases into ``WorkerSlot``), and its
adapter loads in the gRPC ``HealthResponse.num_lora_loads`` and the Prometheus counter
``fuseserve_lora_loads_total``."""

from __future__ import annotations

import json
from types import SimpleNamespace

from prometheus_client import generate_latest

from fuseserve import messages
from fuseserve.proto import worker_pb2 as pb
from fuseserve.worker.server import WorkerServicer
from fuseserve.worker.sim_runner import SimulatedRunner
from fuseserve.worker.worker_metrics import WorkerMetrics


def _record(**kw) -> messages.WorkerRecord:
    return messages.WorkerRecord("w0", "127.0.0.1:1", "m", 16, 100, 2048, 32000, [2], 256, **kw)


def test_the_record_carries_the_adapters_and_an_older_record_reads_as_none():
    rec = messages.WorkerRecord.decode(_record(lora_adapters=["a", "b"]).encode())
    assert rec.lora_adapters == ["a", "b"]
    old = json.loads(_record().encode())
    del old["lora_adapters"]  # written by a worker that predates the field
    assert messages.WorkerRecord.decode(json.dumps(old)).lora_adapters == []


def _runner(loads: int) -> SimpleNamespace:
    return SimpleNamespace(
        info=SimpleNamespace(num_blocks=10), num_free_blocks=7, seqs={}, num_lora_loads=loads
    )


def test_health_reports_the_adapter_loads():
    assert WorkerServicer(_runner(3), "w0", "m").Health(pb.HealthRequest(), None).num_lora_loads == 3
    sim = SimulatedRunner.__new__(SimulatedRunner)  # the property only: no adapters, no loads
    assert sim.num_lora_loads == 0


def test_the_loads_counter_is_read_from_the_runner_at_scrape():
    runner = _runner(0)
    metrics = WorkerMetrics("w0", "m", None, runner)
    line = 'fuseserve_lora_loads_total{model_name="m",worker="w0"}'
    assert f"{line} 0.0" in generate_latest(metrics.registry).decode()
    runner.num_lora_loads = 5
    assert f"{line} 5.0" in generate_latest(metrics.registry).decode()
