"""The compose stack for real, in containers: images built offline, two CPU workers on SmolLM2.

Run by ``./dev.sh test-containers`` (the marker ``containers`` keeps it out of ``./dev.sh test``).
Needs Podman (installed with apt when running as root; skipped with the reason otherwise). Builds the
images with ``deploy/build-images.sh`` (wheelhouse + base image cached under ``deploy/.cache``), brings
up redis, gateway, scheduler and ``--scale worker=2`` with Debian's ``docker-compose`` through
Podman's Docker API (``deploy/podman-compose.sh``), and then:

- the ``openai`` client gets "Paris" through the gateway's published port;
- one worker container is stopped while 8 streams run, and all 8 finish with the text of an
  undisturbed run; the container is then removed and the stack keeps serving;
- ``compose down`` leaves no container of the project behind.

Timings (image build, stack up) and image sizes are printed (``-s`` shows them) and written to
``deploy/.cache/container-test.json``.
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
import urllib.request
from pathlib import Path

import pytest

from fuseserve.redis_launcher import free_port

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "fuseserve-ctest"
SERVICES = ["redis", "gateway", "scheduler", "worker"]
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
UP_TIMEOUT_S = 900
SECRETS = {
    "FUSESERVE_REDIS_PASSWORD": secrets.token_hex(24),
    "FUSESERVE_API_KEY": "sk-" + secrets.token_hex(24),
}
REPORT: dict = {}


def _run(*cmd: str, timeout: float = 600, check: bool = True, env: dict | None = None) -> str:
    result = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout


def _ensure_tools() -> None:
    missing = [t for t in ("podman", "docker-compose", "mmdebstrap") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{', '.join(missing)} not installed, and installing needs root with apt-get")
    packages = ["podman" if t == "podman" else t for t in missing]
    result = subprocess.run(["apt-get", "install", "-y", "-q", *packages], capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True)
        result = subprocess.run(["apt-get", "install", "-y", "-q", *packages], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"apt-get install {' '.join(packages)} failed: {result.stderr[-500:]}")


def _image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def _compose(*args: str, env: dict, timeout: float = 600, check: bool = True) -> str:
    return _run("deploy/podman-compose.sh", "-p", PROJECT, *args, env=env, timeout=timeout, check=check)


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return json.loads(response.read())
    except Exception:  # noqa: BLE001 (not up yet: connection refused, 503, reset)
        return None


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


@pytest.fixture(scope="module")
def stack():
    _ensure_tools()
    t0 = time.monotonic()
    _run("deploy/build-images.sh", env={"WORKER_DEVICES": "cpu"}, timeout=3600)
    REPORT["image_build_s"] = round(time.monotonic() - t0, 1)
    sizes = _run("podman", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}")
    REPORT["image_sizes"] = [line for line in sizes.splitlines() if "localhost/fuseserve" in line]

    port = free_port()
    # The secrets compose requires (README "Deploy" has users put them in .env)
    env = {"WORKER_DEVICE": "cpu", "GATEWAY_PORT": str(port), **SECRETS}
    if _image_exists("localhost/fuseserve-redis:latest"):  # built when no registry answers
        env["REDIS_IMAGE"] = "localhost/fuseserve-redis:latest"
    _compose("down", "-v", "--remove-orphans", env=env, check=False)
    t0 = time.monotonic()
    _compose("up", "-d", "--scale", "worker=2", *SERVICES, env=env)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while (health := _health(port)) is None or health.get("workers") != 2:
        if time.monotonic() > deadline:
            logs = _compose("logs", "--tail", "40", env=env, check=False)
            pytest.fail(
                f"stack not up with 2 workers after {UP_TIMEOUT_S} s (health {health}):\n{logs[-6000:]}"
            )
        time.sleep(3)
    REPORT["stack_up_s"] = round(time.monotonic() - t0, 1)
    while (states := _health_states()) and set(states.values()) != {"healthy"}:  # HEALTHCHECKs pass
        if time.monotonic() > deadline:
            pytest.fail(f"containers not healthy after {UP_TIMEOUT_S} s: {states}")
        time.sleep(3)
    yield port, env
    if os.environ.get("FUSESERVE_KEEP_STACK") != "1":
        _compose("down", "-v", "--remove-orphans", env=env, check=False)
    out = ROOT / "deploy/.cache/container-test.json"
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


def _stream(client, prompt: str, first_token: threading.Event | None = None) -> str:
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    parts = []
    for chunk in stream:
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
    port, _ = stack
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401


def test_openai_client_gets_paris_through_the_published_port(stack):
    port, _ = stack
    client = _client(port)
    t0 = time.monotonic()
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    REPORT["first_request_s"] = round(time.monotonic() - t0, 1)
    REPORT["paris_answer"] = answer.choices[0].message.content
    assert "Paris" in answer.choices[0].message.content


def test_a_worker_stopped_under_load_loses_no_stream(stack):
    port, env = stack
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
    _run("podman", "stop", "-t", "2", victim)
    REPORT["stopped_worker"] = victim
    runner.join(timeout=900)
    assert not runner.is_alive()
    failures = [r for r in results if not isinstance(r, str)]
    assert not failures, failures
    assert results == reference

    _run("podman", "rm", victim)
    assert _containers("worker") == workers[:-1]
    deadline = time.monotonic() + 60
    while (_health(port) or {}).get("workers") != 1:  # the registry forgets the stopped worker
        assert time.monotonic() < deadline, _health(port)
        time.sleep(2)
    assert "Paris" in _stream(client, PROMPT)


def test_compose_down_leaves_nothing_running(stack):
    _, env = stack
    _compose("down", "-v", "--remove-orphans", env=env)
    assert _containers(all_states=True) == []
