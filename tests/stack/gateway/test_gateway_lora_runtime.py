"""Runtime LoRA loading at the gateway (``lora_admin.py``) on a fake scheduler: vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` behind the API key, off unless enabled, OpenAI
error JSON for every refusal (400 bad checkpoint / rank / name, 404 unknown, 409 in use), the Redis
hash every gateway reads (a second gateway serves an adapter the first one loaded). The fake scheduler
drives no worker (its stats record names none), so a load answers once a worker record advertises the
adapter: a thread plays the workers' heartbeat (``advertise``); the stack test
(``tests/stack/test_stack_lora_runtime.py``) runs the whole path."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from gateway_harness import ServedApp
from lora_checkpoints import write_adapter
from tiny_models import llama_config, random_model

from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.gateway.auth import ApiKeys
from fuseserve.messages import RUNTIME_LORA, WorkerRecord, scheduler_stats_key, worker_key

BASE = "base-model"
KEY = "runtime-lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of a tiny LLaMA: ``r8`` (rank 8) and ``r32`` (rank 32, above the limit 16)."""
    hf = random_model(llama_config(), seed=0, dtype=torch.float32)
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {
        name: str(write_adapter(hf, root / name, r, ["q_proj"], seed=r))
        for name, r in (("r8", 8), ("r32", 32))
    }


def _settings(redis_url, source, allow: bool) -> GatewaySettings:
    return GatewaySettings(
        redis_url,
        source=source,
        served_model_name=BASE,
        lora_modules=["sql=/nowhere/sql"],
        api_keys=ApiKeys.load([KEY], env=False),
        allow_runtime_lora=allow,
        admission_cache_s=0,
        disconnect_poll_s=0.1,
    )


@pytest.fixture(scope="module")
def gateways(redis_server, smollm2_source, fake):
    """Two gateways with runtime loading on, one with it off: their base URLs."""
    served = [
        ServedApp(create_app(_settings(redis_server.url, smollm2_source, allow)))
        for allow in (True, True, False)
    ]
    yield [s.url for s in served]
    for s in served:
        s.close()


@pytest.fixture(scope="module", autouse=True)
def advertise(fake):
    """The workers' heartbeat, played: the fake worker's record lists the runtime adapters (not while
    the event it yields is set)."""
    stop, paused = threading.Event(), threading.Event()

    def beat():
        while not stop.wait(0.02):
            raw = fake.r.get(worker_key("fake"))
            if raw and not paused.is_set():
                record = WorkerRecord.decode(raw)
                record.lora_adapters = sorted(fake.r.hkeys(RUNTIME_LORA))
                fake.r.set(worker_key("fake"), record.encode())

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    yield paused
    stop.set()
    t.join()


@pytest.fixture
def http(gateways, fake):
    fake.r.delete(RUNTIME_LORA)
    with httpx.Client(base_url=gateways[0], timeout=60, headers=AUTH) as client:
        yield client
    fake.r.delete(RUNTIME_LORA)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _load(http, name, path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_load_then_every_gateway_serves_it_and_unload_stops_it(http, gateways, fake, checkpoints):
    r = _load(http, "new", checkpoints["r8"])
    assert r.status_code == 200 and "new" in r.text
    assert fake.r.hget(RUNTIME_LORA, "new") == checkpoints["r8"]
    with httpx.Client(base_url=gateways[1], timeout=60, headers=AUTH) as other:
        cards = other.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE), ("new", BASE)]
        done = other.post("/v1/completions", json={"model": "new", "prompt": [5, 6], "max_tokens": 2})
        assert done.status_code == 200, done.text
        assert fake.requests[-1].lora == "new"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "new"}).status_code == 200
        gone = other.post("/v1/completions", json={"model": "new", "prompt": [5], "max_tokens": 1})
        assert _error(gone, 404)["code"] == "model_not_found"
    assert not fake.r.hexists(RUNTIME_LORA, "new")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"lora_name": "x", "lora_path": "/no/such/dir"}, "is not a directory"),
        ({"lora_name": "x", "lora_path": "CHECKPOINT:r32"}, "rank 32 is above max_lora_rank=16"),
        ({"lora_name": "x", "lora_path": "TMP"}, "adapter_config.json"),
        ({"lora_name": BASE, "lora_path": "CHECKPOINT:r8"}, "base model's name"),
        ({"lora_name": "sql", "lora_path": "CHECKPOINT:r8"}, "already loaded"),
        ({"lora_name": "x"}, "lora_path"),
    ],
    ids=["bad-path", "rank", "not-peft", "base-name", "taken", "no-path"],
)
def test_a_bad_load_is_a_400(http, fake, checkpoints, tmp_path, body, says):
    path = body.get("lora_path", "")
    if path.startswith("CHECKPOINT:"):
        body = {**body, "lora_path": checkpoints[path.partition(":")[2]]}
    elif path == "TMP":  # a directory without adapter_config.json
        body = {**body, "lora_path": str(tmp_path)}
    error = _error(http.post("/v1/load_lora_adapter", json=body), 400)
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert fake.r.hlen(RUNTIME_LORA) == 0


def test_a_second_load_of_a_name_is_a_400(http, checkpoints):
    assert _load(http, "new", checkpoints["r8"]).status_code == 200
    assert "already loaded" in _error(_load(http, "new", checkpoints["r8"]), 400)["message"]


def test_unload_refusals(http, checkpoints):
    assert (
        _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"}), 404)["param"] == "lora_name"
    )
    error = _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 400)
    assert "--lora-modules" in error["message"]


def test_unload_is_refused_while_a_request_runs(http, fake, checkpoints):
    """On this gateway: a streamed request still running; in a scheduler: its stats record's
    ``lora_in_use`` (a request of another gateway)."""
    assert _load(http, "new", checkpoints["r8"]).status_code == 200
    fake.token_delay = 0.05
    first, done = threading.Event(), []

    def run():
        body = {"model": "new", "prompt": "tick tock", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                first.set()
                done.append(line)

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(30)
    error = _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "new"}), 409)
    assert "running or waiting requests" in error["message"]
    t.join()
    assert "data: [DONE]" in done and "error" not in "".join(done)
    stats = {"waiting": 1, "running": 0, "time": time.time(), "lora_in_use": ["new"]}
    fake.r.set(scheduler_stats_key("harness"), json.dumps(stats))
    _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "new"}), 409)
    fake.set_waiting(0)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "new"}).status_code == 200


def test_the_api_key_is_needed(gateways, checkpoints):
    body = {"lora_name": "new", "lora_path": checkpoints["r8"]}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert httpx.post(f"{gateways[0]}{path}", json=body, timeout=30).status_code == 401


def test_off_unless_enabled(gateways, fake, checkpoints):
    body = {"lora_name": "new", "lora_path": checkpoints["r8"]}
    r = httpx.post(f"{gateways[2]}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=30)
    assert "--allow-runtime-lora" in _error(r, 404)["message"]
    assert not fake.r.hexists(RUNTIME_LORA, "new")


def test_a_load_no_worker_serves_is_undone(http, fake, checkpoints, advertise, monkeypatch):
    """A load waits for a worker to advertise the adapter; when none does (a path its host cannot
    read, another base model, a worker without --allow-runtime-lora), the entry is removed: a 400."""
    from fuseserve.gateway import lora_admin

    monkeypatch.setattr(lora_admin, "LOAD_WAIT_S", 0.5)
    advertise.set()
    try:
        error = _error(_load(http, "new", checkpoints["r8"]), 400)
    finally:
        advertise.clear()
    assert "no worker serves" in error["message"] and not fake.r.hexists(RUNTIME_LORA, "new")
