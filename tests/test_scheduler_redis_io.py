"""The scheduler service's Redis I/O on a real redis-server: the blocking reader threads read only as
many requests as there is room for, hand aborts over, wake the loop; stats of several schedulers add
up; lease renewal notes leases another scheduler took."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.redis_launcher import launch_redis
from fuseserve.scheduler import redis_io
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.redis_io import RedisInbox
from fuseserve.scheduler.worker_leases import WorkerLeases


@pytest.fixture
def r():
    with launch_redis() as srv:
        client = redis.Redis.from_url(srv.url, decode_responses=True)
        redis_io.setup_streams(client)
        yield client
        client.close()


@pytest.fixture
def inbox(r):
    wakes = []
    box = RedisInbox(r, "sched-a", wake=lambda: wakes.append(1))
    stop = threading.Event()
    box.start(stop)
    yield box, wakes
    stop.set()


def add_requests(r, n: int) -> None:
    for i in range(n):
        msg = messages.RequestMessage(i, f"r{i}", "gw", [1, 2, 3], {"max_new_tokens": 4})
        r.xadd(messages.REQUESTS, msg.encode())


def take_until(box: RedisInbox, kind: str, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        box.wait(0.1)
        got = [entries for k, entries in box.take() if k == kind]
        if got:
            return got
    return []


def test_requests_are_read_only_with_room_and_after_the_last_batch_was_taken(r, inbox):
    box, wakes = inbox
    add_requests(r, 5)
    time.sleep(0.3)
    assert box.take() == []  # no room yet: the requests stay in the stream for another scheduler
    box.set_room(2)
    batches = take_until(box, redis_io.REQUESTS)
    assert [len(b) for b in batches] == [2] and wakes
    time.sleep(0.3)
    assert box.take() == []  # room was 2 and the batch is not applied yet: nothing more is read
    box.set_room(10, batches_taken=1)
    rest = take_until(box, redis_io.REQUESTS)
    ids = [json.loads(f["data"])["seq_id"] for b in batches + rest for _, f in b]
    assert ids == [0, 1, 2, 3, 4]


def test_aborts_are_handed_over_in_order(r, inbox):
    box, wakes = inbox
    for seq_id in (7, 8):
        r.xadd(messages.CONTROL, messages.ControlMessage("abort", seq_id).encode())
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        got += [
            messages.ControlMessage.decode(f).seq_id for b in take_until(box, redis_io.CONTROL) for _, f in b
        ]
    assert got == [7, 8] and wakes


def test_stats_of_several_schedulers_add_up_and_stale_ones_are_skipped():
    now = time.time()
    a = {"waiting": 3, "running": 5, "time": now, "workers": {"w0": {"admitted": 1}}}
    b = {"waiting": 4, "running": 1, "time": now - 1, "workers": {"w1": {"admitted": 2}}}
    dead = {"waiting": 100, "running": 100, "time": now - messages.SCHEDULER_STATS_MAX_AGE_S - 1}
    merged = messages.merge_scheduler_stats([json.dumps(x) for x in (a, b, dead)] + [None, "{bad"], now)
    assert merged["waiting"] == 7 and merged["running"] == 6 and merged["schedulers"] == 2
    assert set(merged["workers"]) == {"w0", "w1"} and merged["time"] == now
    assert messages.merge_scheduler_stats([json.dumps(dead)], now) == {}


def test_read_scheduler_stats_reads_every_schedulers_record(r):
    for name, waiting in (("s1", 2), ("s2", 5)):
        stats = {"waiting": waiting, "running": 0, "time": time.time(), "workers": {}}
        r.set(messages.scheduler_stats_key(name), json.dumps(stats), ex=10)
    assert messages.read_scheduler_stats(r)["waiting"] == 7


def test_lease_renewal_notes_a_lease_another_scheduler_took(r):
    core = EngineCore(EngineConfig(token_budget=64), eos_token_ids=[])
    leases = WorkerLeases(r, "sched-a", core)
    for wid, holder in (("w0", "sched-a"), ("w1", "sched-b")):
        r.set(messages.worker_lease_key(wid), holder, px=1000)
        leases.leased.add(wid)
    leases.renew()
    assert leases._lost == {"w1"}
    assert r.pttl(messages.worker_lease_key("w0")) > 1000  # extended to SCHEDULER_TTL_S
