"""A real Prometheus scrapes a local stack through the project's monitoring/prometheus.yml.

Debian's ``prometheus`` is installed when missing and this runs as root with apt (else skipped,
saying why). The stack is ``fuseserve.serve`` with two schedulers and two simulated workers (real
Redis, schedulers and gateway; the SmolLM2 tokenizer). The config's jobs keep their names and paths;
only the targets are templated to the local ports (compose finds them through DNS). Requests are
sent, 5 of them aborted mid-stream, and the numbers are read back through Prometheus' HTTP API. Then
a queue is held in both schedulers, and the dashboard's own queue-depth queries are checked against
each scheduler's ``/metrics``. About 40 s: marked ``prometheus`` (``./dev.sh test-prometheus``).
"""

from __future__ import annotations

import asyncio
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
from prometheus_client.parser import text_string_to_metric_families
from stack_harness import MODEL

from fuseserve import messages
from fuseserve.redis_launcher import free_port

pytestmark = pytest.mark.prometheus
MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
DASHBOARD = MONITORING / "grafana/dashboards/fuseserve.json"
NUM_OK, NUM_ABORTED, MAX_TOKENS = 12, 5, 24
NUM_SCHEDULERS = NUM_WORKERS = 2
# A queue that holds still, in each scheduler: a scheduler takes at most MAX_NUM_SEQS sequences per
# worker (pull-based reading); KV_BLOCKS hold three HELD_PROMPT-token prompts with their
# HELD_MAX_TOKENS, not a fourth (SplitFuse rule 2: blocks for the whole prompt). Each scheduler, with
# one worker, takes 5 requests (2 more stay in the Redis stream), prefills them one after the other (4
# waiting, then 3), then runs 3 and keeps 2 waiting for about HELD_MAX_TOKENS decode steps (0.18 s
# each, simulated A100 x20; measured: 2 and 2 for over 30 s).
MAX_NUM_SEQS, BLOCK_SIZE, KV_BLOCKS = 5, 16, 300
HELD_PROMPT, HELD_MAX_TOKENS, NUM_HELD = 80 * BLOCK_SIZE, 256, 12
KV_BYTES_PER_TOKEN = 2 * 32 * 4096 * 2  # Llama-2-7B, fp16: K and V of 32 layers of 4096


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
    """host:port of the gateway, the schedulers' and the workers' metrics endpoints (from Redis: each
    scheduler writes its metrics port into its own stats record)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    workers = [
        messages.WorkerRecord.decode(r.get(k)) for k in r.scan_iter(match=f"{messages.WORKER_PREFIX}*")
    ]
    deadline = time.monotonic() + 10

    def metrics_ports() -> list[int]:  # of every scheduler that has written its stats record
        records = [json.loads(r.get(k) or "{}") for k in r.scan_iter(match=messages.SCHEDULER_STATS_PATTERN)]
        return sorted(rec["metrics_port"] for rec in records if rec.get("metrics_port"))

    while len(ports := metrics_ports()) < NUM_SCHEDULERS:
        assert time.monotonic() < deadline, (
            f"{len(ports)} of {NUM_SCHEDULERS} schedulers published a metrics port"
        )
        time.sleep(0.2)
    return {
        "gateway": [f"127.0.0.1:{gateway_port}"],
        "scheduler": [f"127.0.0.1:{port}" for port in ports],
        "worker": [f"127.0.0.1:{w.metrics_port}" for w in workers],
    }


def scheduler_gauge(target: str, name: str) -> float:
    """``name``'s value on one scheduler's own ``/metrics`` (``target``: host:port), summed over its
    series (one: its ``model_name``)."""
    text = httpx.get(f"http://{target}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def dashboard_expr(title: str, ref: str = "A") -> str:
    """The query of the dashboard panel ``title``, target ``ref``, as Grafana sends it (1 m rate windows)."""
    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    (target,) = [t for t in panel["targets"] if t["refId"] == ref]
    return target["expr"].replace("$__rate_interval", "1m")


class Prom:
    """Prometheus' HTTP API on ``base``."""

    def __init__(self, base: str):
        self.http = httpx.Client(base_url=base, timeout=10)

    def vector(self, expr: str) -> list[dict]:
        """The result of an instant query: ``[{"metric": labels, "value": [time, "text"]}, ...]``."""
        data = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert data["status"] == "success", data
        return data["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The scalar result of an instant query (None: empty result)."""
        result = self.vector(expr)
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
    kv_cache_memory = KV_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN  # the simulated worker's KV blocks
    with fuseserve.serve(
        MODEL,
        workers=NUM_WORKERS,
        schedulers=NUM_SCHEDULERS,
        port=port,
        simulate="a100-llama2-7b",
        simulate_slowdown="20",
        max_num_seqs=MAX_NUM_SEQS,
        block_size=BLOCK_SIZE,
        kv_cache_memory=str(kv_cache_memory),
    ) as s:
        yield s, port


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """A real Prometheus scraping ``stack`` every second: ``(Prom, targets)`` (job → host:port)."""
    binary = prometheus_binary()
    server, gateway_port = stack
    tmp_path = tmp_path_factory.mktemp("prometheus")
    targets = stack_targets(server.stack.redis.url, gateway_port)
    config = local_config(tmp_path, targets)
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
        yield prom, targets
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheus_reads_back_what_clients_saw(stack, prometheus):
    server, _ = stack
    prom, _ = prometheus
    up = 'count(up{job=~"gateway|scheduler|worker"} == 1)'
    want = 1 + NUM_SCHEDULERS + NUM_WORKERS
    assert prom.wait(up, float(want)) == want  # every target up, each scheduler on its own
    assert prom.value('count(up{job="scheduler"} == 1)') == NUM_SCHEDULERS

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
    assert prom.value("sum(fuseserve_num_workers)") == NUM_WORKERS  # each worker driven by one scheduler
    assert prom.value("max(fuseserve_token_budget)") > 0
    rules = prom.http.get("/api/v1/rules").json()["data"]["groups"][0]["rules"]
    assert all(rule["health"] == "ok" for rule in rules), rules
    # every dashboard query runs, and every metric it names has series from this stack
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            data = prom.http.get("/api/v1/query", params={"query": expr}).json()
            assert data["status"] == "success", (panel["title"], expr, data)
            for name in set(re.findall(r"\bfuseserve_[a-z0-9_]+", expr)):
                assert prom.value(f'count({{__name__="{name}"}})'), f"{panel['title']}: no {name} series"


async def hold_queue(base: str, check) -> None:
    """Send NUM_HELD long requests (token-id prompts of HELD_PROMPT tokens, each with its own first
    token: no prefix shared), run ``check()`` in a thread while they run, then close them all (the
    clients go away: every sequence is aborted)."""

    async def hold(client: httpx.AsyncClient, i: int) -> None:
        prompt = [1000 + i] + [2000] * (HELD_PROMPT - 1)
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": HELD_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(10, read=300)) as client:
        tasks = [asyncio.create_task(hold(client, i)) for i in range(NUM_HELD)]
        try:
            await asyncio.to_thread(check)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if not isinstance(r, asyncio.CancelledError | type(None))]
    assert not errors, errors


def test_dashboard_queue_depth_is_the_sum_of_every_scheduler(stack, prometheus):
    """Both schedulers hold a queue; the dashboard's "Waiting" query, run by Prometheus, equals the
    sum of the two schedulers' ``fuseserve_num_requests_waiting`` as each one's ``/metrics`` says, and
    its "Per scheduler" query gives each one's own."""
    server, _ = stack
    prom, targets = prometheus
    schedulers = targets["scheduler"]
    waiting = "fuseserve_num_requests_waiting"
    total, per_scheduler = dashboard_expr("Waiting"), dashboard_expr("Per scheduler", "A")
    assert waiting in total and waiting in per_scheduler

    deadline = time.monotonic() + 30  # the schedulers share the workers: one each
    while (workers := [scheduler_gauge(t, "fuseserve_num_workers") for t in schedulers]) != [1.0, 1.0]:
        assert time.monotonic() < deadline, (
            f"workers per scheduler: {dict(zip(schedulers, workers, strict=True))}"
        )
        time.sleep(0.5)

    seen = []

    def check() -> None:
        """A moment when each scheduler's queue held still from one read of its /metrics to the next,
        with Prometheus's queries in between, is compared (the gauges are set every second)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            before = {t: scheduler_gauge(t, waiting) for t in schedulers}
            summed = prom.value(total)
            each = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.vector(per_scheduler)}
            after = {t: scheduler_gauge(t, waiting) for t in schedulers}
            seen.append((before, summed, each))
            if before == after == each and all(v > 0 for v in before.values()):
                assert summed == sum(before.values()), seen[-1]
                return
            time.sleep(0.5)
        raise AssertionError(f"no moment with a queue held still in both schedulers: {seen[-5:]}")

    asyncio.run(hold_queue(server.url, check))
    before, summed, _ = seen[-1]
    print(f"waiting per scheduler {before}, dashboard 'Waiting' {summed}, after {len(seen)} reads")
    # the closed clients' sequences are aborted: nothing is left waiting or running
    assert prom.wait(total, 0.0) == 0.0
    assert prom.wait(dashboard_expr("Queue and running", "B"), 0.0) == 0.0
