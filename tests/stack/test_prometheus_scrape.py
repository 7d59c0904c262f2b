"""A real Prometheus scrapes a local stack through the project's monitoring/prometheus.yml.

Debian's ``prometheus`` is installed when missing and this runs as root with apt (else skipped,
saying why). The stack is ``fuseserve.serve`` with two simulated workers (real Redis, scheduler and
gateway; the SmolLM2 tokenizer). The config's jobs keep their names and paths; only the targets are
templated to the local ports (compose finds them through DNS). Requests are sent, 5 of them aborted
mid-stream, and the numbers are read back through Prometheus' HTTP API. About 40 s: marked
``prometheus`` (``./dev.sh test-prometheus``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from stack_harness import MODEL

from fuseserve import messages
from fuseserve.redis_launcher import free_port

pytestmark = pytest.mark.prometheus
MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
NUM_OK, NUM_ABORTED, MAX_TOKENS = 12, 5, 24


def prometheus_binary() -> str:
    """Path of ``prometheus``, installing Debian's package when possible; skips otherwise."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and this is not root with apt-get (apt install prometheus)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0 or not shutil.which("prometheus"):
        pytest.skip(f"apt-get install prometheus failed: {result.stderr.strip()[-300:]}")
    return shutil.which("prometheus")


def local_config(tmp: Path, targets: dict[str, list[str]]) -> Path:
    """The project's prometheus.yml with each job's service discovery replaced by static ``targets``
    (job → host:port), a 1 s scrape interval, and alerts.yml loaded from beside it."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = ["alerts.yml"]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    shutil.copy(MONITORING / "alerts.yml", tmp / "alerts.yml")
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def stack_targets(redis_url: str, gateway_port: int) -> dict[str, list[str]]:
    """host:port of the gateway, the scheduler's and the workers' metrics endpoints (from Redis)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    workers = [
        messages.WorkerRecord.decode(r.get(k)) for k in r.scan_iter(match=f"{messages.WORKER_PREFIX}*")
    ]
    deadline = time.monotonic() + 10

    def own_stats() -> str | None:  # the (one) scheduler's own stats record
        return next((r.get(k) for k in r.scan_iter(match=messages.SCHEDULER_STATS_PATTERN)), None)

    while not (stats := own_stats()) or not json.loads(stats).get("metrics_port"):
        assert time.monotonic() < deadline, "the scheduler published no metrics port"
        time.sleep(0.2)
    return {
        "gateway": [f"127.0.0.1:{gateway_port}"],
        "scheduler": [f"127.0.0.1:{json.loads(stats)['metrics_port']}"],
        "worker": [f"127.0.0.1:{w.metrics_port}" for w in workers],
    }


class Prom:
    """Prometheus' HTTP API on ``base``."""

    def __init__(self, base: str):
        self.http = httpx.Client(base_url=base, timeout=10)

    def value(self, expr: str) -> float | None:
        """The scalar result of an instant query (None: empty result)."""
        data = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert data["status"] == "success", data
        result = data["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait(self, expr: str, want, timeout: float = 20.0) -> float | None:
        """Query ``expr`` until it equals ``want`` (the last value is returned either way)."""
        deadline = time.monotonic() + timeout
        while (got := self.value(expr)) != want and time.monotonic() < deadline:
            time.sleep(0.5)
        return got


def stream(base: str, prompt: str, abort_after: int | None) -> int:
    """One streamed completion; returns the tokens the client received: ``usage.completion_tokens``
    when it runs to the end, else the tokens of the ``abort_after`` chunks it read before leaving."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "logprobs": 0}
    body["stream_options"] = {"include_usage": True}
    if abort_after is not None:
        body.update(max_tokens=4000, ignore_eos=True)
    received = 0
    with (
        httpx.Client(base_url=base, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                return chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                received += len((choice.get("logprobs") or {}).get("tokens") or [])
            if abort_after is not None and received >= abort_after:
                return received  # closing the stream mid-generation: the client goes away
    raise AssertionError("the stream ended without usage")


@pytest.fixture(scope="module")
def stack(smollm2_source):
    import fuseserve

    port = free_port()
    with fuseserve.serve(MODEL, workers=2, port=port, simulate="a100-llama2-7b", simulate_slowdown="20") as s:
        yield s, port


def test_prometheus_reads_back_what_clients_saw(stack, tmp_path):
    binary = prometheus_binary()
    server, gateway_port = stack
    config = local_config(tmp_path, stack_targets(server.stack.redis.url, gateway_port))
    prom_port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}"]
        + [f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        prom = Prom(f"http://127.0.0.1:{prom_port}")
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if prom.http.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 30 s"
            time.sleep(0.2)
        assert prom.wait('count(up{job=~"gateway|scheduler|worker"} == 1)', 4.0) == 4.0  # 1+1+2 targets up

        with ThreadPoolExecutor(8) as pool:
            ok = sum(pool.map(lambda i: stream(server.url, f"Request {i} asks:", None), range(NUM_OK)))
        # every token the finished clients received, and nothing else, is counted
        tokens = "sum(fuseserve_generation_tokens_total)"
        assert prom.wait(tokens, float(ok)) == float(ok)

        with ThreadPoolExecutor(NUM_ABORTED) as pool:
            seen = sum(pool.map(lambda i: stream(server.url, f"Abort {i}:", 3), range(NUM_ABORTED)))
        aborts = 'sum(fuseserve_request_success_total{finished_reason="abort"})'
        assert prom.wait(aborts, float(NUM_ABORTED)) == float(NUM_ABORTED)
        assert prom.wait("sum(fuseserve_num_requests_in_flight)", 0.0) == 0.0
        assert prom.wait("sum(fuseserve_kv_cache_usage_perc)", 0.0) == 0.0
        assert prom.wait("sum(fuseserve_kv_cache_blocks_used)", 0.0) == 0.0
        assert prom.wait("sum(fuseserve_num_requests_running)", 0.0) == 0.0  # set each second
        assert prom.wait("sum(fuseserve_num_requests_waiting)", 0.0) == 0.0
        # an aborted client leaves with the tokens it read; the gateway may have received a few more
        assert prom.value(tokens) >= ok + seen
        stops = 'sum(fuseserve_request_success_total{finished_reason=~"stop|length"})'
        assert prom.value(stops) == NUM_OK
        assert prom.value('sum(fuseserve_request_success_total{finished_reason="error"})') == 0
        # a TTFT sample per request, and the alert rules loaded with their metrics
        assert prom.value("sum(fuseserve_time_to_first_token_seconds_count)") == NUM_OK + NUM_ABORTED
        assert prom.value("sum(fuseserve_iteration_tokens_total_count)") > 0
        assert prom.value("sum(fuseserve_num_workers)") == 2
        assert prom.value("max(fuseserve_token_budget)") > 0
        rules = prom.http.get("/api/v1/rules").json()["data"]["groups"][0]["rules"]
        assert all(rule["health"] == "ok" for rule in rules), rules
        # every dashboard query runs, and every metric it names has series from this stack
        dashboard = json.loads((MONITORING / "grafana/dashboards/fuseserve.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m")
                data = prom.http.get("/api/v1/query", params={"query": expr}).json()
                assert data["status"] == "success", (panel["title"], expr, data)
                for name in set(re.findall(r"\bfuseserve_[a-z0-9_]+", expr)):
                    assert prom.value(f'count({{__name__="{name}"}})'), f"{panel['title']}: no {name} series"
    finally:
        proc.terminate()
        proc.wait(10)
