"""The container stack: docker-compose.yml, Dockerfiles, Prometheus rules and the Grafana dashboard.

Static checks only (no Docker engine needed). ``docker-compose config`` (Debian package
``docker-compose``) validates the file against the Compose specification when it is installed, and
``promtool`` (Debian package ``prometheus``) checks the Prometheus files when it is installed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"

SUBCOMMANDS = {"gateway", "scheduler", "worker"}
"""`fuseserve <subcommand>` names the stack runs (the CLI contract)."""
FLAGS = {
    "--redis-url",
    "--model",
    "--host",
    "--port",
    "--metrics-port",
    "--advertise-host",
    "--drain-timeout",
}
"""Flags of those subcommands that compose may pass."""
REDIS_URL = "redis://redis:6379"

COUNTERS = {
    "fuseserve_requests_total",
    "fuseserve_generated_tokens_total",
    "fuseserve_prompt_tokens_total",
    "fuseserve_preemptions_total",
}
GAUGES = {
    "fuseserve_queue_depth",
    "fuseserve_running_seqs",
    "fuseserve_kv_free_blocks",
    "fuseserve_workers_alive",
}
HISTOGRAMS = {
    "fuseserve_request_latency_seconds",
    "fuseserve_ttft_seconds",
    "fuseserve_inter_token_latency_seconds",
    "fuseserve_step_tokens",
    "fuseserve_step_seconds",
}
_METRIC_RE = re.compile(r"\bfuseserve_[a-z0-9_]+")


def _load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load_yaml(ROOT / "docker-compose.yml")


def _argv(service: dict) -> list[str]:
    """The service's command as argv; ``sh -c "exec ..."`` is unwrapped."""
    command = service["command"]
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2])
        if argv[0] == "exec":
            argv = argv[1:]
    return argv


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression, histogram series suffixes checked and removed."""
    names = set()
    for name in _METRIC_RE.findall(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def _check_exprs(exprs: list[str]) -> set[str]:
    known = COUNTERS | GAUGES | HISTOGRAMS
    used: set[str] = set()
    for expr in exprs:
        names = _metric_names(expr)
        assert names, f"query uses no fuseserve metric: {expr}"
        assert names <= known, f"unknown metric(s) {sorted(names - known)} in: {expr}"
        for name in names & HISTOGRAMS:
            assert re.search(rf"{name}_(bucket|sum|count)\b", expr), f"bare histogram name in: {expr}"
        used |= names
    return used


# ------------------------------------------------------------------------------------ compose file
def test_compose_services(compose):
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "scheduler", "worker", "prometheus", "grafana"}
    assert services["redis"]["image"].split(":-")[-1].startswith("redis:")  # ${REDIS_IMAGE:-redis:...}
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    for volume in ("model-cache",):
        assert volume in compose["volumes"]


def test_fuseserve_commands_follow_the_cli_contract(compose):
    for name in SUBCOMMANDS:
        argv = _argv(compose["services"][name])
        assert argv[0] == "fuseserve" and argv[1] == name, argv
        flags = [a for a in argv[2:] if a.startswith("--")]
        assert set(flags) <= FLAGS, f"{name}: unknown flags {set(flags) - FLAGS}"
        assert argv[argv.index("--redis-url") + 1] == REDIS_URL
        assert all(not a.startswith("-") for a in argv[2:] if not a.startswith("--")), argv
    gateway = _argv(compose["services"]["gateway"])
    assert gateway[gateway.index("--host") + 1] == "0.0.0.0"
    assert gateway[gateway.index("--port") + 1] == "8000"
    assert gateway[gateway.index("--model") + 1] == "${MODEL:-smollm2-135m-instruct}"
    worker = _argv(compose["services"]["worker"])
    assert worker[worker.index("--model") + 1] == "${MODEL:-smollm2-135m-instruct}"
    assert worker[worker.index("--host") + 1] == "0.0.0.0"
    assert worker[worker.index("--advertise-host") + 1] == "$$HOSTNAME"  # the container's own name


def test_worker_is_scalable_and_reserves_a_gpu(compose):
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert any(v.split(":")[0] == "model-cache" for v in worker["volumes"])


def test_build_files_exist_and_copy_sources_exist(compose):
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    dockerfiles = []
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        context = ROOT / service["build"]["context"]
        dockerfile = context / service["build"]["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        dockerfiles.append((context, dockerfile))
    assert len(dockerfiles) == 3
    for context, dockerfile in dockerfiles:
        for line in dockerfile.read_text().splitlines():
            parts = line.split()
            if not parts or parts[0].upper() != "COPY" or any(p.startswith("--from") for p in parts):
                continue
            sources = [p for p in parts[1:-1] if not p.startswith("--")]
            for source in sources:
                assert (context / source).exists(), f"{dockerfile}: COPY source {source} missing"
                assert source == "." or source not in ignored, f"{source} is in .dockerignore"
    worker_dockerfile = (ROOT / "services/worker/Dockerfile").read_text()
    assert "ARG DEVICE=" in worker_dockerfile and "FROM base-${DEVICE}" in worker_dockerfile
    assert "flash-attn" in worker_dockerfile and "torch==2.13.0" in worker_dockerfile
    assert "download.pytorch.org/whl/cpu" in worker_dockerfile


def test_bind_mounts_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: mount source {source} missing"


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose not installed (apt docker-compose)"
)
def test_compose_config_validates_against_the_compose_spec():
    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------ prometheus
def _mounts(service: dict) -> dict[str, Path]:
    """Container path → host path of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = ROOT / source
    return out


def test_prometheus_config(compose):
    config = _load_yaml(MONITORING / "prometheus.yml")
    mounts = _mounts(compose["services"]["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == ROOT / "monitoring/prometheus.yml"
    for rule_file in config["rule_files"]:
        assert rule_file in mounts and mounts[rule_file].is_file(), f"rule file {rule_file} not mounted"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "scheduler", "worker"}
    assert jobs["gateway"]["static_configs"][0]["targets"] == ["gateway:8000"]
    scheduler = _argv(compose["services"]["scheduler"])
    metrics_port = scheduler[scheduler.index("--metrics-port") + 1]
    assert jobs["scheduler"]["static_configs"][0]["targets"] == [f"scheduler:{metrics_port}"]
    dns = jobs["worker"]["dns_sd_configs"][0]
    worker = _argv(compose["services"]["worker"])
    assert dns["names"] == ["worker"] and dns["type"] == "A"
    assert str(dns["port"]) == worker[worker.index("--metrics-port") + 1]


def test_alert_rules():
    rules = [rule for group in _load_yaml(MONITORING / "alerts.yml")["groups"] for rule in group["rules"]]
    used = _check_exprs([str(rule["expr"]) for rule in rules])
    # No worker alive, KV cache nearly full, p95 TTFT high, error rate high.
    assert {"fuseserve_workers_alive", "fuseserve_kv_free_blocks", "fuseserve_ttft_seconds"} <= used
    assert "fuseserve_requests_total" in used
    for rule in rules:
        assert rule["alert"] and rule["annotations"]["summary"] and rule["labels"]["severity"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt prometheus)")
def test_promtool_accepts_config_and_rules(tmp_path):
    # promtool resolves rule_files relative to the config: copy both side by side.
    config = _load_yaml(MONITORING / "prometheus.yml")
    config["rule_files"] = ["alerts.yml"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        result = subprocess.run(["promtool", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------ grafana
def test_grafana_provisioning_and_dashboard(compose):
    provisioning = MONITORING / "grafana/provisioning"
    datasource = _load_yaml(provisioning / "datasources/prometheus.yml")["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = _load_yaml(provisioning / "dashboards/dashboards.yml")["providers"][0]
    mounts = _mounts(compose["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning"] == provisioning
    assert mounts[provider["options"]["path"]] == MONITORING / "grafana/dashboards"

    dashboard = json.loads((MONITORING / "grafana/dashboards/fuseserve.json").read_text())
    assert dashboard["uid"] == "fuseserve" and dashboard["panels"]
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"], f"panel {panel['title']} has no query"
        exprs += [target["expr"] for target in panel["targets"]]
    used = _check_exprs(exprs)
    assert used == COUNTERS | GAUGES | HISTOGRAMS  # every exported metric is on the dashboard
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
