"""The compose stack for real, in containers: images built offline, two CPU workers on SmolLM2.

Run by ``./dev.sh test-containers`` (the marker ``containers`` keeps it out of ``./dev.sh test``).
Needs Podman (installed with apt when running as root; skipped with the reason otherwise). Builds the
images with ``deploy/build-images.sh`` (wheelhouse and base root filesystems cached in
``$FUSESERVE_DEPLOY_CACHE``, default ``~/.cache/fuseserve/deploy``), brings up redis, gateway,
``--scale scheduler=2``, ``--scale worker=2`` and, with ``--profile monitoring``, Prometheus, with Debian's
``docker-compose`` through Podman's Docker API (``deploy/podman-compose.sh``), and then:

- the ``openai`` client gets "Paris" through the gateway's published port, which refuses a missing
  or wrong API key;
- ``convert-model`` compiled the C++ CPU attention operator once, and each worker chose it (its log
  says so) without compiling its own;
- no container restarted on the way up (each starts through ``deploy/restart-backoff.sh``);
- Prometheus (the offline Debian image, on ``monitoring/prometheus.yml`` and the alert rules) has
  every target up: the gateway, both schedulers (each found by DNS, scraped on its own) and both
  workers;
- one worker container is stopped (SIGTERM: it drains) while 8 streams run, and all 8 finish with
  the text of an undisturbed run; the container is then removed and the stack keeps serving;
- the gateway's token counter, as Prometheus scraped it, equals the tokens the clients received
  (``usage.completion_tokens`` of every request of this module);
- ``compose down -v`` leaves no container, network or volume of the project behind, and
  ``podman-compose.sh`` stops the Podman API service and health-check loop it started.

Timings (image build, time from ``up`` to each stage of ready) and image sizes are printed (``-s``
shows them) and written to ``deploy/.cache/container-test.json``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from fuseserve.redis_launcher import free_port

# The first test's setup builds the images and starts the stack: up to ~25 min on a fresh machine,
# beyond the suite's 900 s per test.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "fuseserve-ctest"
PROFILE = ["--profile", "monitoring"]
SCALE = ["--scale", "scheduler=2", "--scale", "worker=2"]
TARGETS_UP = {"gateway": 1, "scheduler": 2, "worker": 2}  # Prometheus' targets up, by job
PROMPT = "What is the capital of France?"
STREAM_PROMPTS = [
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Give a synonym for happy.",
    "What is the largest planet?",
    "Say hello in French.",
    "Name a fruit that is yellow.",
    "What do bees make?",
]
UP_TIMEOUT_S = 1200
SECRETS = {
    "FUSESERVE_REDIS_PASSWORD": secrets.token_hex(24),
    "FUSESERVE_API_KEY": "sk-" + secrets.token_hex(24),
}
CONTAINERS_CONF = ROOT / "deploy/podman/containers.conf"  # podman's runtime settings (runc, rlimits)
PODMAN_SOCKET_DIR = Path(os.environ.get("PODMAN_SOCKET_DIR", "/run/fuseserve-podman"))
REPORT: dict = {}
RECEIVED = {"completion_tokens": 0}
"""Generated tokens the clients of this module received (``usage.completion_tokens``, summed)."""
_received_lock = threading.Lock()


def _run(*cmd: str, timeout: float = 600, check: bool = True, env: dict | None = None) -> str:
    env = {"CONTAINERS_CONF": str(CONTAINERS_CONF), **os.environ, **(env or {})}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def _ensure_tools() -> None:
    missing = [t for t in ("podman", "docker-compose", "mmdebstrap", "runc") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{', '.join(missing)} not installed, and installing needs root with apt-get")
    result = subprocess.run(["apt-get", "install", "-y", "-q", *missing], capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True)
        result = subprocess.run(["apt-get", "install", "-y", "-q", *missing], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"apt-get install {' '.join(missing)} failed: {result.stderr[-500:]}")


def _image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def _compose(*args: str, env: dict, timeout: float = 600, check: bool = True) -> str:
    return _run(
        "deploy/podman-compose.sh", "-p", PROJECT, *PROFILE, *args, env=env, timeout=timeout, check=check
    )


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except Exception:  # noqa: BLE001 (not up yet: connection refused, 503, reset)
        return None


def _health(port: int) -> dict | None:
    return _get_json(f"http://127.0.0.1:{port}/health")


def _containers(service: str | None = None, all_states: bool = False) -> list[str]:
    cmd = [
        "podman",
        "ps",
        "--format",
        "{{.Names}}",
        "--filter",
        f"label=com.docker.compose.project={PROJECT}",
    ]
    if service:
        cmd += ["--filter", f"label=com.docker.compose.service={service}"]
    if all_states:
        cmd.append("-a")
    return sorted(_run(*cmd).split())


def _health_states() -> dict[str, str]:
    """Container name -> health status ("healthy", "starting", "unhealthy") of the project."""
    names = _containers()
    out = _run("podman", "inspect", "--format", "{{.Name}} {{.State.Health.Status}}", *names)
    return dict(line.split() for line in out.splitlines() if line.strip())


def _targets(prometheus_port: int) -> list[dict]:
    """Prometheus's active scrape targets (``/api/v1/targets``), [] while it does not answer."""
    data = _get_json(f"http://127.0.0.1:{prometheus_port}/api/v1/targets?state=active")
    return (data or {}).get("data", {}).get("activeTargets", [])


def _up_by_job(targets: list[dict]) -> dict[str, int]:
    """Job -> number of its targets whose last scrape succeeded."""
    up: dict[str, int] = {}
    for target in targets:
        if target["health"] == "up":
            up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
    return up


def _query(prometheus_port: int, expr: str) -> float | None:
    """The value of an instant query that yields one sample, None when it yields none."""
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    result = (_get_json(url) or {}).get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def stack():
    _ensure_tools()
    t0 = time.monotonic()
    _run("deploy/build-images.sh", env={"WORKER_DEVICES": "cpu"}, timeout=3600)
    REPORT["image_build_s"] = round(time.monotonic() - t0, 1)
    sizes = _run("podman", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}")
    REPORT["image_sizes"] = [line for line in sizes.splitlines() if "localhost/fuseserve" in line]

    port, prometheus_port = free_port(), free_port()
    # The secrets compose requires (README "Deploy" has users put them in .env)
    env = {
        "WORKER_DEVICE": "cpu",
        "WORKER_THREADS": str(max(1, (os.cpu_count() or 1) // 2)),  # two workers share this host's cores
        # the drain test compares texts with an undisturbed run's: a stream's batches differ between
        # runs (two schedulers, timing), and bf16 matmuls round differently for another batch shape
        # (a greedy near-tie flipped in 2 of 2 runs); fp32 as the stack tests' recovery_stack does
        "WORKER_DTYPE": "float32",
        "GATEWAY_PORT": str(port),
        "PROMETHEUS_PORT": str(prometheus_port),
        **SECRETS,
    }
    for variable, image in (
        ("REDIS_IMAGE", "localhost/fuseserve-redis:latest"),  # built when no registry answers
        ("PROMETHEUS_IMAGE", "localhost/fuseserve-prometheus:latest"),
    ):
        if _image_exists(image):
            env[variable] = image
    _compose("down", "-v", "--remove-orphans", env=env, check=False)
    try:  # torn down also when the stack fails to come up
        t0 = time.monotonic()
        deadline = t0 + UP_TIMEOUT_S
        # `up` returns once every container has started: the gateway and workers after convert-model
        _compose("up", "-d", *SCALE, env=env, timeout=UP_TIMEOUT_S)
        REPORT["compose_up_returned_s"] = round(time.monotonic() - t0, 1)
        while (health := _health(port)) is None or health.get("workers") != 2:
            if time.monotonic() > deadline:
                logs = _compose("logs", "--tail", "40", env=env, check=False)
                pytest.fail(
                    f"stack not up with 2 workers after {UP_TIMEOUT_S} s (health {health}):\n{logs[-6000:]}"
                )
            time.sleep(3)
        REPORT["two_workers_registered_s"] = round(time.monotonic() - t0, 1)
        while (states := _health_states()) and set(states.values()) != {"healthy"}:  # HEALTHCHECKs pass
            if time.monotonic() > deadline:
                pytest.fail(f"containers not healthy after {UP_TIMEOUT_S} s: {states}")
            time.sleep(3)
        REPORT["all_containers_healthy_s"] = round(time.monotonic() - t0, 1)
        REPORT["containers"] = sorted(states)
        while _up_by_job(targets := _targets(prometheus_port)) != TARGETS_UP:
            if time.monotonic() > deadline:
                pytest.fail(f"Prometheus targets not all up after {UP_TIMEOUT_S} s: {targets}")
            time.sleep(3)
        REPORT["prometheus_targets_up_s"] = round(time.monotonic() - t0, 1)
        yield port, prometheus_port, env
    finally:
        if os.environ.get("FUSESERVE_KEEP_STACK") != "1":
            _compose("down", "-v", "--remove-orphans", env=env, check=False)
        out = ROOT / "deploy/.cache/container-test.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(REPORT, indent=1))
        print("\ncontainer test:", json.dumps(REPORT, indent=1))


def _client(port: int):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key=SECRETS["FUSESERVE_API_KEY"],
        timeout=300,
        max_retries=0,
    )


def _count(usage) -> None:
    with _received_lock:
        RECEIVED["completion_tokens"] += usage.completion_tokens


def _stream(client, prompt: str, first_token: threading.Event | None = None) -> str:
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = []
    for chunk in stream:
        if chunk.usage is not None:
            _count(chunk.usage)
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if first_token is not None:
                first_token.set()
    return "".join(parts)


def _run_streams(client, events: list[threading.Event] | None = None) -> list[str | BaseException]:
    results: list[str | BaseException] = [""] * len(STREAM_PROMPTS)

    def one(i: int) -> None:
        try:
            results[i] = _stream(client, STREAM_PROMPTS[i], events[i] if events else None)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(STREAM_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def test_the_published_port_needs_the_api_key(stack):
    port, _, _ = stack
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401


def test_openai_client_gets_paris_through_the_published_port(stack):
    port, _, _ = stack
    client = _client(port)
    t0 = time.monotonic()
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    _count(answer.usage)
    REPORT["first_request_s"] = round(time.monotonic() - t0, 1)
    REPORT["paris_answer"] = answer.choices[0].message.content
    assert "Paris" in answer.choices[0].message.content


def _logs(container: str) -> str:
    logs = subprocess.run(["podman", "logs", container], capture_output=True, text=True)
    return logs.stdout + logs.stderr


def test_each_worker_chose_the_compiled_cpu_attention_operator(stack):
    """convert-model compiled the operator once; each worker loaded it (no build of its own) and
    logged its choice."""
    (convert,) = [c for c in _containers(all_states=True) if "convert-model" in c]
    assert "CPU attention operator: built" in _logs(convert), _logs(convert)[-3000:]
    for worker in _containers("worker"):
        logs = _logs(worker)
        chosen = [line for line in logs.splitlines() if "attention backend:" in line]
        REPORT.setdefault("attention_backend", {})[worker] = chosen[-1] if chosen else None
        assert chosen and chosen[-1].endswith("attention backend: cpu (auto)"), logs[-3000:]
        assert "building the CPU attention operator" not in logs, logs[-3000:]


def test_no_container_restarted(stack):
    """Nothing crash-looped on the way up (a restart would be delayed by deploy/restart-backoff.sh,
    the entrypoint of every long-running service)."""
    names = _containers()
    out = _run(
        "podman", "inspect", "--format", "{{.Name}} {{.RestartCount}} {{json .Config.Entrypoint}}", *names
    )
    restarts = {}
    for line in out.splitlines():
        name, count, entrypoint = line.split(" ", 2)
        restarts[name] = int(count)
        assert "restart-backoff.sh" in entrypoint, line
    REPORT["restart_counts"] = restarts
    assert set(restarts.values()) == {0}, restarts


def test_prometheus_scrapes_every_service_and_loads_the_alert_rules(stack):
    _, prometheus_port, _ = stack
    targets = _targets(prometheus_port)
    assert _up_by_job(targets) == TARGETS_UP, targets
    assert all(t["health"] == "up" for t in targets), targets
    rules = _get_json(f"http://127.0.0.1:{prometheus_port}/api/v1/rules")["data"]["groups"]
    names = {rule["name"] for group in rules for rule in group["rules"]}
    assert "FuseserveNoLiveWorker" in names, names
    assert all(rule["health"] == "ok" for group in rules for rule in group["rules"]), rules
    assert _query(prometheus_port, "sum(fuseserve_num_workers)") == 2.0  # each worker driven by one
    assert _query(prometheus_port, "count(fuseserve_num_workers)") == 2.0  # a series per scheduler


def test_a_worker_stopped_under_load_loses_no_stream(stack):
    port, _, env = stack
    client = _client(port)
    reference = _run_streams(client)
    assert all(isinstance(r, str) and r for r in reference), reference

    workers = _containers("worker")
    assert len(workers) == 2, workers
    events = [threading.Event() for _ in STREAM_PROMPTS]
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(_run_streams(client, events)))
    runner.start()
    for event in events:  # every stream has started producing tokens
        assert event.wait(300)
    victim = workers[-1]
    t0 = time.monotonic()
    _run("podman", "stop", "-t", "60", victim)  # SIGTERM, then (the compose stop_grace_period) SIGKILL
    REPORT["stopped_worker"] = victim
    REPORT["worker_stop_s"] = round(time.monotonic() - t0, 1)
    exit_code = _run("podman", "inspect", "--format", "{{.State.ExitCode}}", victim).strip()
    REPORT["stopped_worker_exit_code"] = exit_code
    REPORT["stopped_worker_drain_log"] = [  # how the drain went (its timings, what was handed back)
        line[-200:] for line in _logs(victim).splitlines() if "drain" in line.lower()
    ][-8:]
    runner.join(timeout=900)
    assert not runner.is_alive()
    failures = [r for r in results if not isinstance(r, str)]
    assert not failures, failures
    assert results == reference
    assert exit_code == "0"  # it drained and exited by itself, before the grace period's SIGKILL

    _run("podman", "rm", victim)
    assert _containers("worker") == workers[:-1]
    deadline = time.monotonic() + 60
    while (_health(port) or {}).get("workers") != 1:  # the registry forgets the stopped worker
        assert time.monotonic() < deadline, _health(port)
        time.sleep(2)
    assert "Paris" in _stream(client, PROMPT)


def test_prometheus_counts_the_tokens_the_clients_received(stack):
    port, prometheus_port, _ = stack
    _stream(_client(port), PROMPT)  # at least one request, also when this test runs alone
    expected = float(RECEIVED["completion_tokens"])
    deadline = time.monotonic() + 60  # scraped every 5 s
    while (counted := _query(prometheus_port, "sum(fuseserve_generation_tokens_total)")) != expected:
        assert time.monotonic() < deadline, (
            f"Prometheus counted {counted} tokens, clients received {expected}"
        )
        time.sleep(2)
    REPORT["generation_tokens"] = {"clients": expected, "prometheus": counted}


def test_compose_down_leaves_nothing_running(stack):
    _, _, env = stack
    _compose("down", "-v", "--remove-orphans", env=env)
    assert _containers(all_states=True) == []
    for kind in ("network", "volume"):  # compose names them <project>_<name>
        names = _run("podman", kind, "ls", "--format", "{{.Name}}").split()
        assert [n for n in names if n.startswith(f"{PROJECT}_")] == [], (kind, names)
    others = _run("podman", "ps", "-aq", "--filter", "label=com.docker.compose.project").split()
    if not others:  # no other compose project on this Podman: the script stopped what it started
        for pidfile in ("service.pid", "healthchecks.pid"):
            assert not (PODMAN_SOCKET_DIR / pidfile).exists(), pidfile
        socket = str(PODMAN_SOCKET_DIR / "podman.sock")
        ps = _run("ps", "-eo", "args")
        assert f"system service --time=0 unix://{socket}" not in ps
        assert "podman healthcheck run" not in ps
