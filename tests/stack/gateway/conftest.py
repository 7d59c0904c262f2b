"""Fixtures of the gateway tests: module-scoped Redis, fake scheduler and served gateway (each starts
once per test module), and an autouse reset of the fake scheduler after every test."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import FakeScheduler, ServedApp
from gateway_http import GRACE_S, MAX_BODY, MAX_QUEUE

from fuseserve.config import RequestLimits
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.redis_launcher import launch_redis


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
