"""A simulated stack (``fuseserve.serve(..., simulate=PRESET)``): real Redis (with its generated
password), scheduler and gateway with the SmolLM2 tokenizer and an API key, two simulated workers
(slowdowns 1 and 3), driven by the ``openai`` client; the scheduler runs with latency targets
(passes sized by ``slo_budget``).

Overload: three times the admission capacity (the per-key concurrency limit,
``--max-concurrent-per-key``) at once. Every answer must be 200 or 429 (with ``Retry-After`` and
OpenAI's error JSON) within a deadline; afterwards the KV caches are empty again and a normal request
succeeds."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis
from stack_harness import MODEL, busiest_worker, openai_client

from fuseserve import messages
from fuseserve.redis_launcher import REDIS_PASSWORD_ENV, free_port

PROMPT = "Simulated workers answer with deterministic tokens:"
KEY = "sk-sim-stack-test"
CAPACITY = 4  # requests in flight per key
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def server(smollm2_source):
    import fuseserve

    with fuseserve.serve(
        MODEL,
        workers=2,
        port=free_port(),
        simulate="a100-llama2-7b",
        simulate_slowdown="1,3",
        target_itl=0.25,
        target_prefill_rate=512,
        api_key=KEY,
        max_concurrent_per_key=CAPACITY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, api_key=KEY)


def test_completion_max_tokens_usage_and_determinism(client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 9
    assert a.choices[0].text.strip()
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    assert b.choices[0].text == a.choices[0].text  # tokens are a function of the prompt and position
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == a.choices[0].text


def test_stop_string_and_chat(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content


def test_workers_register_simulated_with_metrics_ports(server):
    r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
    recs = [messages.WorkerRecord.decode(r.get(k)) for k in r.scan_iter(f"{messages.WORKER_PREFIX}*")]
    assert sorted(rec.worker_id for rec in recs) == ["worker-0", "worker-1"]
    assert all(rec.metrics_port and rec.eos_token_ids == [] for rec in recs)
    argv = server.stack.argv
    assert argv["worker-0"][-2:] == ["--simulate-slowdown", "1.0"]
    assert argv["worker-1"][-2:] == ["--simulate-slowdown", "3.0"]


def test_top_once_reads_every_service(server, client, capsys):
    from fuseserve.cli import main

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    argv = ["top", "--url", server.url, "--redis-url", server.stack.redis.url, "--once", "--json"]
    assert main([*argv, "--interval", "0.2"]) == 0
    frame = json.loads(capsys.readouterr().out)
    assert frame["errors"] == [] and frame["scheduler"]["schedulers"] == 1
    assert frame["scheduler"]["workers"] == 2 and frame["gateway"]["in_flight"] == 0
    assert sorted(w["worker"] for w in frame["workers"]) == ["worker-0", "worker-1"]
    assert all(w["kv_usage"] == 0 and w["blocks_total"] > 0 for w in frame["workers"])
    assert main(["top", "--url", server.url, "--once", "--interval", "0"]) == 0  # the rich table
    assert "in flight" in capsys.readouterr().out


# --------------------------------------------------------------------------- overload and secrets
async def _one(client: httpx.AsyncClient, i: int) -> tuple[int, dict, str]:
    body = {"model": MODEL, "prompt": f"request {i} of a burst", "max_tokens": 48, "ignore_eos": True}
    if i % 3 == 0:  # some stream, some ask for two choices
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            text = (await r.aread()).decode()
            return r.status_code, dict(r.headers), text
    r = await client.post("/v1/completions", json={**body, "n": 1 + i % 2})
    return r.status_code, dict(r.headers), r.text


async def _burst(url: str, n: int) -> list[tuple[int, dict, str]]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=DEADLINE_S) as client:
        return await asyncio.wait_for(asyncio.gather(*(_one(client, i) for i in range(n))), DEADLINE_S)


def _kv_in_use(r: redis.Redis) -> int | None:
    """KV blocks in use over all workers, from the schedulers' stats (None before the first write)."""
    stats = messages.read_scheduler_stats(r)
    if not stats:
        return None
    workers = stats["workers"]
    return sum(w["num_blocks"] - w["free_blocks"] for w in workers.values())


def test_three_times_capacity_gets_200_or_429_then_kv_is_free(server):
    assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    results = asyncio.run(_burst(server.url, 3 * CAPACITY))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= CAPACITY and 429 in statuses, statuses
    for status, headers, text in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert "--max-concurrent-per-key" in json.loads(text)["error"]["message"]
        elif text.startswith("data:"):
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        else:
            assert all(c["finish_reason"] == "length" for c in json.loads(text)["choices"])

    r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
    deadline = time.monotonic() + 15
    while (used := _kv_in_use(r)) != 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert used == 0, f"{used} KV blocks still in use after the burst"
    after = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "after the burst", "max_tokens": 5},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5


def test_children_get_secrets_by_environment_not_argv(server):
    stack = server.stack
    password = stack.redis.password
    assert password
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(stack.redis.address).ping()
    for name, argv in stack.argv.items():
        assert password not in " ".join(argv) and KEY not in " ".join(argv), name
    for name, proc in stack.procs:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        assert password not in cmdline and KEY not in cmdline, name


def test_a_restarted_child_connects_with_the_password_again(server):
    stack = server.stack
    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    old_address = messages.WorkerRecord.decode(r.get(messages.worker_key("worker-1"))).address
    old = dict(stack.procs)["worker-1"]
    old.kill()
    old.wait()
    stack.supervise()  # what `fuseserve serve` runs every 0.5 s
    new = dict(stack.procs)["worker-1"]
    assert new.pid != old.pid
    environ = b""
    for _ in range(40):  # /proc/PID/environ reads empty for a moment right after the exec
        assert new.poll() is None, f"the restarted worker exited with {new.returncode}"
        with open(f"/proc/{new.pid}/environ", "rb") as f:
            environ = f.read()
        if environ:
            break
        time.sleep(0.05)
    assert f"{REDIS_PASSWORD_ENV}={stack.redis.password}".encode() in environ.split(b"\0")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # registered again (port 0: a new address) through an AUTHed client
        raw = r.get(messages.worker_key("worker-1"))
        if raw and messages.WorkerRecord.decode(raw).address != old_address:
            break
        assert new.poll() is None, "the restarted worker exited"
        time.sleep(0.25)
    else:
        pytest.fail("the restarted worker did not register again")


def test_scheduler_gets_the_latency_targets(server):
    """``fuseserve serve --target-itl --target-prefill-rate`` hands them to the scheduler (the other
    tests here run with them: a simulated worker has no start-up profile, so its passes are sized
    once 8 are measured)."""
    scheduler = next(argv for name, argv in server.stack.argv.items() if name.startswith("scheduler"))
    assert scheduler[-4:] == ["--target-itl", "0.25", "--target-prefill-rate", "512"]


def test_a_worker_lost_under_load_is_driven_again_when_it_returns(server, client):
    """The core drops a worker whose stream breaks with plans in flight; the scheduler still holds its
    lease, and must take the worker back when it registers again under the same id."""
    from concurrent.futures import ThreadPoolExecutor

    stack = server.stack
    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)

    def one(i: int) -> str:
        c = client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=48, temperature=0)
        return c.choices[0].finish_reason

    with ThreadPoolExecutor(6) as ex:
        running = [ex.submit(one, i) for i in range(6)]
        victim, _ = busiest_worker(stack, ["worker-0", "worker-1"])
        old = dict(stack.procs)[victim]
        old.kill()
        old.wait()
        assert [f.result(timeout=120) for f in running] == ["length"] * 6  # recomputed on the other worker

    def driven() -> set[str]:
        return set(messages.read_scheduler_stats(r).get("workers", {}))

    deadline = time.monotonic() + 30
    while victim in driven():  # the stats are written once a second
        assert time.monotonic() < deadline, "the scheduler still drives the killed worker"
        time.sleep(0.25)
    stack.supervise()
    deadline = time.monotonic() + 60
    while victim not in driven():
        assert time.monotonic() < deadline, (
            f"the scheduler did not take the restarted worker back: {driven()}"
        )
        time.sleep(0.25)
