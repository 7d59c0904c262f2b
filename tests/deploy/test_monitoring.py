"""monitoring/ against what the services export: every alert rule and dashboard query names only
metrics the gateway, scheduler and worker export, every exported metric is documented in
monitoring/README.md, and promtool accepts the config and rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from fuseserve.gateway.gateway_metrics import GatewayMetrics
from fuseserve.scheduler.service.scheduler_metrics import SchedulerMetrics
from fuseserve.worker.worker_metrics import WorkerMetrics, pass_size_label

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
_NAME_RE = re.compile(r"\bfuseserve_[a-z0-9_]+")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> dict[str, set[str]]:
    """Service → the series names its metrics module exports (``_total``, ``_bucket`` ... included)."""
    runner = SimpleNamespace(info=SimpleNamespace(num_blocks=8), num_free_blocks=8, num_lora_loads=0)
    registries = {
        "gateway": GatewayMetrics("m").registry,
        "scheduler": SchedulerMetrics(None).registry,
        "worker": WorkerMetrics("w0", "m", None, runner).registry,
    }
    out = {}
    for service, registry in registries.items():
        out[service] = {fam.name + s for fam in registry.collect() for s in _SUFFIXES[fam.type]}
    assert all(out.values()), {service: len(names) for service, names in out.items()}  # the checks need some
    return out


def _exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    out = [(f"alert {r['alert']}", str(r["expr"])) for g in rules for r in g["rules"]]
    dashboard = json.loads((MONITORING / "grafana/dashboards/fuseserve.json").read_text())
    out += [(f"panel {p['title']}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    return out


def test_each_metric_has_one_owner():
    names = exported()
    services = list(names)
    for i, a in enumerate(services):
        for b in services[i + 1 :]:
            assert not names[a] & names[b], f"{a} and {b} both export {sorted(names[a] & names[b])}"


def test_alerts_and_dashboard_name_only_exported_metrics():
    known = set().union(*exported().values())
    used = set()
    for where, expr in _exprs():
        names = set(_NAME_RE.findall(expr))
        assert names, f"{where} names no fuseserve metric: {expr}"
        assert names <= known, f"{where} names {sorted(names - known)}, not exported: {expr}"
        used |= names
    alerts = {
        r["alert"]
        for g in yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    # the alerts: no live worker, KV > 95%, TTFT p95, 5xx rate, scheduler stalled
    assert {
        "FuseserveNoLiveWorker",
        "FuseserveKVCacheFull",
        "FuseserveHighTTFT",
        "FuseserveHigh5xxRate",
        "FuseserveSchedulerStalled",
    } <= alerts
    # the dashboard's subjects: throughput, TTFT/ITL, pass fullness vs budget, KV, queue, preemptions,
    # errors, LoRA (adapters running / waiting, loads, load time)
    for name in (
        "fuseserve_generation_tokens_total",
        "fuseserve_time_to_first_token_seconds_bucket",
        "fuseserve_inter_token_latency_seconds_bucket",
        "fuseserve_iteration_tokens_total_sum",
        "fuseserve_token_budget",
        "fuseserve_kv_cache_usage_perc",
        "fuseserve_num_requests_waiting",
        "fuseserve_num_preemptions_total",
        "fuseserve_http_requests_total",
        "fuseserve_lora_requests_info",
        "fuseserve_lora_loads_total",
        "fuseserve_lora_load_seconds_bucket",
    ):
        assert name in used, f"nothing shows {name}"


# An aggregation (over every scraped replica) applied right to a metric, or to its rate.
_AGGREGATED = re.compile(
    r"\b(sum|max|min|count)\s*(by\s*\([^)]*\)\s*)?\(\s*((rate|increase|irate)\s*\(\s*)?fuseserve_[a-z0-9_]+"
)
# Gauges that are a ratio or a setting of one worker: adding them over replicas means nothing.
_NOT_ADDITIVE = ("fuseserve_kv_cache_usage_perc", "fuseserve_token_budget")


def test_queries_add_replicas_up_correctly():
    """Several gateways, schedulers and workers are scraped at once (monitoring/README.md, "How the
    dashboard and the alerts add replicas up"): every metric a query names is aggregated over them
    (counters as ``sum(rate())``, gauges by ``sum``, histograms by ``sum by (le)``), nothing is
    averaged, and a ratio or a setting is never summed."""
    for where, expr in _exprs():
        names = _NAME_RE.findall(expr)
        aggregated = _AGGREGATED.findall(expr)
        assert len(aggregated) == len(names), f"{where}: a metric is not aggregated over replicas: {expr}"
        assert not re.search(r"\bavg\s*(by\s*\([^)]*\)\s*)?\(", expr), f"{where} averages: {expr}"
        for name in _NOT_ADDITIVE:
            assert not re.search(rf"\bsum\s*(by\s*\([^)]*\)\s*)?\(\s*{name}\b", expr), f"{where} sums {name}"


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (Debian: apt install prometheus)"
)
def test_scheduler_stalled_fires_for_the_stalled_scheduler_of_two(tmp_path):
    """``promtool test rules``: scheduler a plans passes, b holds a queue and plans none, c holds a
    queue and has never planned a pass (no series). The alert fires for b and c, not a; summed over
    schedulers (a's passes hiding b's stall) it would not fire at all."""
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    waiting = "fuseserve_num_requests_waiting"
    passes = "fuseserve_iteration_tokens_total_count"
    series = [
        (f'{waiting}{{instance="a:9101",model_name="m"}}', "3x40"),
        (f'{waiting}{{instance="b:9101",model_name="m"}}', "2x40"),
        (f'{waiting}{{instance="c:9101",model_name="m"}}', "1x40"),
        (f'{passes}{{instance="a:9101",model_name="m",worker="w0"}}', "0+1x40"),
        (f'{passes}{{instance="b:9101",model_name="m",worker="w1"}}', "5x40"),
    ]
    expected = [
        {
            "exp_labels": {"severity": "critical", "instance": f"{i}:9101"},
            "exp_annotations": {
                "summary": f"Scheduler {i}:9101 is not stepping while requests wait",
                "description": f"{n} sequences wait in scheduler {i}:9101 and it planned no pass in 2 minutes.",
            },
        }
        for i, n in (("b", 2), ("c", 1))
    ]
    case = {
        "interval": "15s",
        "input_series": [{"series": name, "values": values} for name, values in series],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "FuseserveSchedulerStalled", "exp_alerts": expected},
        ],
    }
    test = {"rule_files": ["alerts.yml"], "evaluation_interval": "15s", "tests": [case]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        ["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_is_documented_with_its_owner():
    readme = (MONITORING / "README.md").read_text()
    for service, names in exported().items():
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            documented = f"`{base}`" in readme or f"`{base.removesuffix('_total')}` (`_total`)" in readme
            assert documented, f"{service} metric {base} is not in monitoring/README.md"


def test_gauges_read_kv_at_scrape_time_and_pass_size_classes():
    runner = SimpleNamespace(info=SimpleNamespace(num_blocks=8), num_free_blocks=2, num_lora_loads=0)
    m = WorkerMetrics("w0", "m", None, runner)
    value = lambda name: m.registry.get_sample_value(name, {"model_name": "m", "worker": "w0"})  # noqa: E731
    assert value("fuseserve_kv_cache_usage_perc") == 0.75 and value("fuseserve_kv_cache_blocks_used") == 6
    runner.num_free_blocks = 8  # freed by an abort: no pass needed to read empty
    assert value("fuseserve_kv_cache_usage_perc") == 0.0 and value("fuseserve_kv_cache_blocks_total") == 8
    assert [pass_size_label(n) for n in (1, 16, 17, 4096, 5000)] == [
        "1-16",
        "1-16",
        "17-64",
        "1025-4096",
        "4097+",
    ]


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (Debian: apt install prometheus)"
)
def test_promtool_accepts_config_and_rules(tmp_path):
    # promtool resolves rule_files relative to the config: copy both side by side.
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["rule_files"] = ["alerts.yml"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        result = subprocess.run(["promtool", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_scheduler_passes_budget_and_queue_time_counted_once():
    from fuseserve.types import SeqChunk, StepPlan

    slots = {"w0": SimpleNamespace(token_budget=256, running=[])}
    scheduler = SimpleNamespace(slots=slots, waiting=[], pass_observers=[])
    core = SimpleNamespace(scheduler=scheduler, on_plans=None)
    m = SchedulerMetrics(None)
    m.queue_depth.set(3)  # before the first worker: labelled "unknown", dropped by set_model
    m.set_model("m")
    m.watch(core)
    m.note_arrival(1)
    m.note_arrival(2)
    m.forget(2)  # aborted while waiting: never observed
    chunk = lambda sid, n: SeqChunk(sid, 0, n, list(range(n)), True)  # noqa: E731
    core.on_plans({"w0": StepPlan(0, [chunk(1, 100)])}, 0.001)
    core.on_plans({"w0": StepPlan(1, [chunk(1, 1)]), "w1": StepPlan(0, [], [5])}, 0.002)  # w1: a free only
    value = m.registry.get_sample_value
    assert value("fuseserve_num_requests_waiting", {"model_name": "unknown"}) is None
    assert value("fuseserve_iteration_tokens_total_count", {"model_name": "m", "worker": "w0"}) == 2
    assert value("fuseserve_iteration_tokens_total_sum", {"model_name": "m", "worker": "w0"}) == 101
    assert value("fuseserve_iteration_tokens_total_count", {"model_name": "m", "worker": "w1"}) is None
    assert value("fuseserve_request_queue_time_seconds_count", {"model_name": "m"}) == 1
    assert value("fuseserve_plan_build_seconds_count", {"model_name": "m"}) == 2
    assert value("fuseserve_token_budget", {"model_name": "m", "worker": "w0"}) == 256
    for observe in core.scheduler.pass_observers:  # what Scheduler.schedule_workers calls per plan
        observe("w0", 640, 600)
        observe("w1", 640, 0)  # a plan that only frees: no pass, as for the tokens histogram
    assert value("fuseserve_iteration_token_budget_sum", {"model_name": "m", "worker": "w0"}) == 640
    assert value("fuseserve_iteration_token_budget_count", {"model_name": "m", "worker": "w1"}) is None
    m.drop_worker("w0")
    slots.clear()
    assert value("fuseserve_token_budget", {"model_name": "m", "worker": "w0"}) is None


def test_scheduler_counters_are_exported_at_zero_before_any_event():
    """A dashboard's ``rate(fuseserve_num_preemptions_total[1m])`` needs the series before the first
    preemption (a labelled counter exports nothing until its child exists)."""
    from prometheus_client import generate_latest

    m = SchedulerMetrics(None)
    m.set_model("smollm2")
    text = generate_latest(m.registry).decode()
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert f'fuseserve_{name}_total{{model_name="smollm2"}} 0.0' in text, name


def test_scheduler_metric_children_are_cached_per_model_and_worker():
    """The observers run for every plan: label children are looked up once, and a new model name or
    a departed worker drops the cached child with its series (observations go to a fresh one)."""
    m = SchedulerMetrics(None)
    m.set_model("a")
    assert m.running is m.running
    m.observe_budget("w0", 64, 10)
    m.drop_worker("w0")
    m.observe_budget("w0", 32, 10)  # a worker of that name came back: one observation, not two
    value = m.registry.get_sample_value
    assert value("fuseserve_iteration_token_budget_count", {"model_name": "a", "worker": "w0"}) == 1
    m.set_model("b")
    m.running.set(3)
    m.observe_budget("w0", 16, 10)
    assert value("fuseserve_num_requests_running", {"model_name": "b"}) == 3
    assert value("fuseserve_num_requests_running", {"model_name": "a"}) is None
    assert value("fuseserve_iteration_token_budget_sum", {"model_name": "b", "worker": "w0"}) == 16
