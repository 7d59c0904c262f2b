"""Pytest fixtures and HTTP helpers shared by ``test_gateway.py`` and ``test_gateway_robustness.py``.

Each test module imports the fixtures it uses by name (the autouse ``_reset_fake`` included), so
module-scoped ones (Redis, the fake scheduler, the served gateway) start once per module.
"""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_harness import FakeScheduler, ServedApp

from fuseserve.config import RequestLimits
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.redis_launcher import launch_redis

MODEL = "smollm2-135m-instruct"
MAX_BODY = 64 * 1024
MAX_QUEUE = 8
GRACE_S = 1.0  # seconds without a scheduler heartbeat before requests in flight fail


@pytest.fixture(scope="module")
def redis_server():
    with launch_redis() as server:
        yield server


@pytest.fixture(scope="module")
def fake(redis_server):
    sched = FakeScheduler(redis_server.url)
    yield sched
    sched.close()


@pytest.fixture(autouse=True)
def _reset_fake(fake):
    yield
    fake.token_delay, fake.error_next, fake.error_after, fake.duplicate, fake.burst = (
        0.0,
        None,
        None,
        False,
        False,
    )
    if fake.dead:
        fake.revive()
    fake.add_worker()
    fake.set_waiting(0)


@pytest.fixture(scope="module")
def app(redis_server, smollm2_source, fake):
    settings = GatewaySettings(
        redis_server.url,
        source=smollm2_source,
        limits=RequestLimits(max_body_bytes=MAX_BODY),
        max_queue=MAX_QUEUE,
        admission_cache_s=0,
        disconnect_poll_s=0.1,
        scheduler_grace_s=GRACE_S,
        scheduler_check_s=0.2,
    )
    return create_app(settings)


@pytest.fixture(scope="module")
def server(app):
    served = ServedApp(app)
    yield served
    served.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=20) as client:
        yield client


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def post(http, path, **body):
    return http.post(path, json={"model": MODEL, **body})


def sse_events(http, path, **body) -> list:
    """All ``data:`` payloads of a streamed request (JSON decoded, "[DONE]" kept as is)."""
    out = []
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_works(http):
    r = post(http, "/v1/completions", prompt="Still working?", max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Still working"


def assert_error(r, status: int, param: str | None = None, contains: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err["message"]
    return err
