"""The container stack: docker-compose.yml, Dockerfiles, Prometheus rules and the Grafana dashboard.

Static checks only (no Docker engine needed). ``docker-compose config`` (Debian package
``docker-compose``) validates the file against the Compose specification when it is installed, and
``promtool`` (Debian package ``prometheus``) checks the Prometheus files when it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"

SUBCOMMANDS = {"gateway", "scheduler", "worker"}
"""`fuseserve <subcommand>` names the stack runs (the CLI contract)."""
FLAGS = {
    "--redis-url",
    "--log-level",  # accepted after every sub-command (fuseserve/cli.py)
    "--model",
    "--host",
    "--port",
    "--metrics-port",
    "--advertise-host",
    "--drain-timeout",
    "--threads",
    "--dtype",
}
"""Flags of those subcommands that compose may pass."""
REDIS_URL = "redis://redis:6379"


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


# ------------------------------------------------------------------------------------ compose file
def test_compose_services(compose):
    services = compose["services"]
    assert set(services) == {
        "redis",
        "convert-model",
        "gateway",
        "scheduler",
        "worker",
        "prometheus",
        "grafana",
    }
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
    assert worker[worker.index("--dtype") + 1] == "${WORKER_DTYPE:-auto}"


LONG_RUNNING = {"redis", "gateway", "scheduler", "worker", "prometheus", "grafana"}
BACKOFF = "/usr/local/lib/fuseserve/restart-backoff.sh"


def test_restarts_back_off(compose):
    """Every long-running service restarts on failure through deploy/restart-backoff.sh (Podman has
    no back-off of its own); the one-shot model conversion is not restarted."""
    services = compose["services"]
    assert set(services) - LONG_RUNNING == {"convert-model"}
    for name in LONG_RUNNING:
        service = services[name]
        assert service["restart"] == "on-failure", name
        assert service["entrypoint"] == ["sh", BACKOFF], name
        assert f"./deploy/restart-backoff.sh:{BACKOFF}:ro" in service["volumes"], name
        assert isinstance(service["command"], list) and service["command"], name  # the whole argv
    assert services["convert-model"]["restart"] == "no"


def test_restart_backoff_doubles_and_resets(tmp_path):
    """Quick restarts wait 1, 2, 4 ... s (capped), a start long after the previous one does not,
    and SIGTERM during the pause exits 0 at once (the command is not run)."""
    state = tmp_path / "state"
    env = {**os.environ, "RESTART_BACKOFF_STATE": str(state), "RESTART_BACKOFF_MAX_S": "2"}

    def start(*command: str) -> subprocess.CompletedProcess:
        script = ROOT / "deploy/restart-backoff.sh"
        return subprocess.run(
            ["sh", str(script), *command], capture_output=True, text=True, env=env, timeout=30
        )

    waits = []
    for _ in range(4):
        result = start("sh", "-c", "echo ran; exit 3")
        assert result.returncode == 3 and result.stdout == "ran\n"  # the command's own exit status
        waits.append(re.findall(r"waiting (\d+) s", result.stderr))
    assert waits == [[], ["1"], ["2"], ["2"]]  # doubling, capped by RESTART_BACKOFF_MAX_S
    starts, last = state.read_text().split()
    state.write_text(f"{starts} {int(last) - 121}\n")  # the previous run lasted longer than 120 s
    assert "waiting" not in start("true").stderr
    state.write_text(f"5 {int(time.time())}\n")  # the 6th quick start: a 16 s pause
    proc = subprocess.Popen(
        ["sh", str(ROOT / "deploy/restart-backoff.sh"), "sleep", "60"],
        env={**env, "RESTART_BACKOFF_MAX_S": "60"},
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "waiting 16 s" in proc.stderr.readline()  # printed once its SIGTERM trap is set
    proc.terminate()
    assert proc.wait(timeout=5) == 0
    proc.stderr.close()


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


_DEFAULTS = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")


def _published(port) -> tuple[str, str] | None:
    """(host address, host port) of one ``ports`` entry, variables replaced by their defaults;
    None for a container port that is not published."""
    if isinstance(port, dict):  # long syntax
        return (port.get("host_ip") or "0.0.0.0", str(port["published"])) if "published" in port else None
    parts = _DEFAULTS.sub(r"\1", str(port)).split(":")
    if len(parts) == 1:
        return ("0.0.0.0", parts[0])  # "8000": published on a random host port, every interface
    return (parts[0] if len(parts) == 3 else "0.0.0.0", parts[-2])


def test_only_the_gateway_is_published_beyond_loopback(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host, _ = _published(port)
            assert name == "gateway" or host == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    assert [_published(p) for p in compose["services"]["gateway"]["ports"]] == [("0.0.0.0", "8000")]
    for name in ("redis", "scheduler", "worker"):  # Redis and the workers' gRPC: compose network only
        assert "ports" not in compose["services"][name], name


REQUIRED = re.compile(r"^\$\{(FUSESERVE_[A-Z_]+):\?[^}]+\}$")
"""``${VAR:?message}``: compose refuses to start without VAR and prints the message."""


def test_redis_requires_a_password_every_service_uses(compose):
    services = compose["services"]
    redis_env = services["redis"]["environment"]
    assert REQUIRED.match(redis_env["FUSESERVE_REDIS_PASSWORD"]).group(1) == "FUSESERVE_REDIS_PASSWORD"
    assert redis_env["REDISCLI_AUTH"] == redis_env["FUSESERVE_REDIS_PASSWORD"]  # the healthcheck's ping
    script = (
        _argv(services["redis"]) if services["redis"]["command"][0] != "sh" else services["redis"]["command"]
    )
    text = " ".join(script)
    assert "requirepass" in text and "$$FUSESERVE_REDIS_PASSWORD" in text and "redis-server" in text
    assert "--requirepass" not in text  # in a config file, not on the command line
    for name in SUBCOMMANDS:
        env = services[name]["environment"]
        assert REQUIRED.match(env["FUSESERVE_REDIS_PASSWORD"]), name
    assert REQUIRED.match(services["gateway"]["environment"]["FUSESERVE_API_KEY"])  # keys required
    from fuseserve.config import API_KEY_ENV
    from fuseserve.redis_launcher import REDIS_PASSWORD_ENV

    assert {API_KEY_ENV, REDIS_PASSWORD_ENV} <= set(services["gateway"]["environment"])


SECRETS = {"FUSESERVE_REDIS_PASSWORD": "redis-secret", "FUSESERVE_API_KEY": "sk-test"}


def _compose_config(env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose not installed (apt docker-compose)"
)
def test_compose_config_validates_against_the_compose_spec():
    result = _compose_config(SECRETS)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)["services"]
    assert config["gateway"]["environment"]["FUSESERVE_API_KEY"] == "sk-test"
    for name, service in config.items():
        for port in service.get("ports", []):
            assert name == "gateway" or _published(port)[0] == "127.0.0.1", (name, port)
    for missing in SECRETS:  # one clear error naming the missing variable
        result = _compose_config({k: v for k, v in SECRETS.items() if k != missing})
        assert result.returncode != 0 and f"set {missing} in .env" in result.stderr, result.stderr


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
    # every service is discovered through Docker's DNS (scaled replicas included), on its metrics port
    ports = {"gateway": "8000"}
    for name in ("scheduler", "worker"):
        argv = _argv(compose["services"][name])
        ports[name] = argv[argv.index("--metrics-port") + 1]
    for name, port in ports.items():
        dns = jobs[name]["dns_sd_configs"][0]
        assert dns["names"] == [name] and dns["type"] == "A" and str(dns["port"]) == port


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
    for panel in dashboard["panels"]:  # the queries are checked in tests/deploy/test_monitoring.py
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"], f"panel {panel['title']} has no query"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
