"""The scheduler service's Redis I/O on a real redis-server: the blocking reader threads read only as
many requests as there is room for, hand aborts over, wake the loop; stats of several schedulers add
up; lease renewal notes leases another scheduler took."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from stack_harness import wait_for

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.redis_launcher import launch_redis
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.scheduler import TokenEvent
from fuseserve.scheduler.sequence import FinishReason
from fuseserve.scheduler.service import redis_io, request_claims
from fuseserve.scheduler.service.redis_io import RedisInbox
from fuseserve.scheduler.service.request_claims import RequestClaims
from fuseserve.scheduler.service.worker_leases import WorkerLeases
from fuseserve.types import PromptLogprobs, SampledToken, TokenLogprob


@pytest.fixture
def r():
    with launch_redis() as srv:
        client = redis.Redis.from_url(srv.url, decode_responses=True)
        redis_io.setup_streams(client)
        yield client
        client.close()


class _CountedCondition(threading.Condition):
    """``RedisInbox``'s condition, counting the looks the request reader takes at its room."""

    def __init__(self):
        super().__init__()
        self.looks = 0

    def wait_for(self, predicate, timeout=None):
        def look():
            self.looks += 1
            return predicate()

        return super().wait_for(look, timeout)


@pytest.fixture
def inbox(r):
    wakes = []
    box = RedisInbox(r, "sched-a", wake=lambda: wakes.append(1))
    box._cond = _CountedCondition()
    stop = threading.Event()
    box.start(stop)
    yield box, wakes
    stop.set()


def reader_looked_twice(box: RedisInbox, room: int) -> None:
    """Give the request reader ``room`` (the room it has already) and wait until it has looked at it
    twice: had the first look sent it reading, the second comes after that read was handed over."""
    for _ in range(2):
        looks = box._cond.looks
        box.set_room(room)
        wait_for(lambda looks=looks: box._cond.looks > looks, 30, "the request reader looking at its room")


def add_requests(r, n: int) -> None:
    for i in range(n):
        msg = messages.RequestMessage(i, f"r{i}", "gw", [1, 2, 3], {"max_new_tokens": 4})
        r.xadd(messages.REQUESTS, msg.encode())


def take_until(box: RedisInbox, kind: str, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        got = [entries for k, entries in box.take() if k == kind]
        if got:
            return got
    return []


def test_requests_are_read_only_with_room_and_after_the_last_batch_was_taken(r, inbox, monkeypatch):
    box, wakes = inbox
    reads: list[int] = []  # the count of each XREADGROUP of the request reader
    xreadgroup = r.xreadgroup

    def counted(*args, **kwargs):
        reads.append(kwargs["count"])
        return xreadgroup(*args, **kwargs)

    monkeypatch.setattr(r, "xreadgroup", counted)
    add_requests(r, 5)
    reader_looked_twice(box, 0)
    # no room yet: the requests stay in the stream for another scheduler
    assert box.take() == [] and reads == []
    box.set_room(2)
    batches = take_until(box, redis_io.REQUESTS)
    assert [len(b) for b in batches] == [2] and wakes and reads == [2]
    reader_looked_twice(box, 2)
    # room was 2 and the batch is not applied yet: nothing more is read
    assert box.take() == [] and reads == [2]
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
    assert r.pttl(messages.worker_lease_key("w0")) > 1000  # extended to the lease TTL


#: every field a wire event may carry, at its default (a reader must take them spelled out too)
WIRE_DEFAULTS = {
    "index": -1,
    "token_id": None,
    "logprob": None,
    "top_logprobs": [],
    "hidden": False,
    "finish_reason": None,
    "error": None,
    "cached_tokens": 0,
    "prompt_logprobs": None,
    "fence": 0,
}


EVENTS = [
    TokenEvent(1, SampledToken(1, 42), index=0, cached_tokens=16),
    TokenEvent(2, SampledToken(2, 0, logprob=0.0), index=3),
    TokenEvent(3, SampledToken(3, 7, -0.5, [TokenLogprob(7, -0.5), TokenLogprob(9, -1.5)]), index=1),
    TokenEvent(4, SampledToken(4, 2), FinishReason.STOP, hidden=True, index=9),
    TokenEvent(5, None, FinishReason.ABORT, error="no worker is available", error_status=503),
    TokenEvent(6, None, index=-1, prompt_logprobs=PromptLogprobs(6, 1, [-0.25], [[TokenLogprob(5, -0.25)]])),
    TokenEvent(7, SampledToken(7, 11), FinishReason.LENGTH, index=4),
    TokenEvent(8, SampledToken(8, 3), index=2, fence=3),  # a request taken over twice
]


def test_compact_wire_decodes_to_the_same_event():
    wire = [ev.to_wire() for ev in EVENTS]
    assert wire[0] == {"seq_id": 1, "index": 0, "token_id": 42, "cached_tokens": 16}
    assert wire[1] == {"seq_id": 2, "index": 3, "token_id": 0, "logprob": 0.0}
    assert wire[7] == {"seq_id": 8, "index": 2, "token_id": 3, "fence": 3}
    assert wire[4] == {
        "seq_id": 5,
        "finish_reason": "abort",
        "error": {"message": "no worker is available", "type": "service_unavailable", "status": 503},
    }
    assert messages.decode_events(messages.encode_events(EVENTS)) == EVENTS
    assert messages.decode_events(messages.encode_events(wire)) == EVENTS
    spelled_out = [{**WIRE_DEFAULTS, **w} for w in wire]  # every field present: the same events
    assert messages.decode_events(messages.encode_events(spelled_out)) == EVENTS


def test_publisher_writes_acks_and_reconnects(r):
    pub = redis_io.LoopConnection(r)
    add_requests(r, 2)
    entries = r.xreadgroup(messages.SCHEDULER_GROUP, "sched-a", {messages.REQUESTS: ">"}, count=2)[0][1]
    ids = [eid for eid, _ in entries]
    wire = [ev.to_wire() for ev in EVENTS]
    pub.publish({"gw1": wire[:3], "gw2": wire[3:]}, ids[:1])
    pub.flush()  # the replies: the commands ran
    got = {
        gw: [e for _, f in r.xrange(messages.responses_stream(gw)) for e in messages.decode_events(f)]
        for gw in ("gw1", "gw2")
    }
    assert got == {"gw1": EVENTS[:3], "gw2": EVENTS[3:]}
    assert r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)["pending"] == 1
    assert [eid for eid, _ in r.xrange(messages.REQUESTS)] == ids[1:]  # acknowledged and deleted
    r.client_kill_filter(_type="normal", skipme=True)  # the publisher's connection is gone
    pub.publish({}, ids[1:])
    pub.flush()
    assert r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)["pending"] == 0
    r.set(messages.responses_stream("bad"), "not a stream")
    pub.publish({"bad": wire[:1], "gw1": wire[:1]})  # pipelined: its error comes with the next call,
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        pub.publish({"gw1": wire[1:2]})  # which is sent all the same
    pub.flush()  # every reply was read: the connection is still in step
    assert r.xlen(messages.responses_stream("gw1")) == 3
    r.client_kill_filter(_type="normal", skipme=True)  # lost after a publish, before its replies:
    pub.publish({"gw1": wire[2:3]})
    pub.flush()  # sent again on a new connection
    assert r.xlen(messages.responses_stream("gw1")) >= 4
    pub.close()


def test_discovery_reads_records_and_live_schedulers_in_one_call(r):
    core = EngineCore(EngineConfig(token_budget=64), eos_token_ids=[])
    leases = WorkerLeases(r, "sched-a", core)
    assert leases.read_records() == ({}, 0)
    recs = [
        messages.WorkerRecord(f"w{i}", f"127.0.0.1:{5000 + i}", "m", 16, 100, 512, 1000, [2], 64)
        for i in range(3)
    ]
    for rec in recs:
        r.set(messages.worker_key(rec.worker_id), rec.encode())
    for i in range(1500):  # more keys than one SCAN page
        r.set(f"other:{i}", 1)
    for name in ("sched-a", "sched-b"):
        r.set(messages.scheduler_live_key(name), 1)
    records, live = leases.read_records()
    assert records == {rec.worker_id: rec for rec in recs} and live == 2
    recs[1].draining = True
    r.set(messages.worker_key("w1"), recs[1].encode())
    r.delete(messages.worker_key("w2"))
    again, _ = leases.read_records()
    assert (
        again == {"w0": recs[0], "w1": recs[1]} and again["w0"] is records["w0"]
    )  # unchanged: not decoded again


def test_lease_renewal_loads_a_script_redis_lost(r):
    core = EngineCore(EngineConfig(token_budget=64), eos_token_ids=[])
    leases = WorkerLeases(r, "sched-a", core)
    r.set(messages.worker_lease_key("w0"), "sched-a", px=1000)
    leases.leased.add("w0")
    r.script_flush()  # a restarted Redis
    leases.renew()
    assert not leases._lost and r.pttl(messages.worker_lease_key("w0")) > 1000
    r.script_flush()  # the heartbeat's way: the commands on its own connection
    r.pexpire(messages.worker_lease_key("w0"), 1000)
    wids, commands = leases.renew_commands()
    replies = redis_io.LoopConnection(r).call(commands)
    assert isinstance(replies[0], redis.exceptions.NoScriptError)
    leases.note_renewals(wids, replies)
    assert not leases._lost and r.pttl(messages.worker_lease_key("w0")) > 1000


def test_claim_command_takes_idle_entries_with_their_fields_and_delivery_counts(r):
    add_requests(r, 3)
    r.xreadgroup(messages.SCHEDULER_GROUP, "dead", {messages.REQUESTS: ">"}, count=3)
    first = r.xrange(messages.REQUESTS)[0][0]
    r.xdel(messages.REQUESTS, first)  # deleted while pending
    conn = redis_io.LoopConnection(r)
    claims = RequestClaims(r)
    idle = messages.CLAIM_IDLE_MS
    (reply,) = conn.call([claims.claim_command("sched-a", 10, idle)])
    assert isinstance(reply, redis.exceptions.NoScriptError)  # EVALSHA before the script was loaded
    claims.load()
    (reply,) = conn.call([claims.claim_command("sched-a", 10, idle)])
    assert request_claims.parse_claim(reply) == ("0-0", [])  # not idle long enough yet
    live = [e for e, _ in r.xrange(messages.REQUESTS)]
    hand_back = dict(idle=messages.HANDBACK_IDLE_MS, justid=True)
    r.xclaim(messages.REQUESTS, messages.SCHEDULER_GROUP, "dead", 0, [*live, first], **hand_back)
    (reply,) = conn.call([claims.claim_command("sched-a", 10, idle)])
    _, entries = request_claims.parse_claim(reply)
    claimed = {e: (fields, count) for e, fields, count in entries}
    assert [messages.RequestMessage.decode(claimed.pop(e)[0]).seq_id for e in live] == [1, 2]
    assert claimed in ({}, {first: ({}, 0)})  # the deleted entry: left out, or without fields
    # a second takeover: the delivery count (the request's fence) grows
    r.xclaim(messages.REQUESTS, messages.SCHEDULER_GROUP, "sched-a", 0, live, **hand_back)
    (reply,) = conn.call([claims.claim_command("sched-b", 10, idle)])
    assert [(e, count) for e, _, count in request_claims.parse_claim(reply)[1] if e in live] == [
        (live[0], 3),
        (live[1], 3),
    ]
    conn.close()


def test_touch_keeps_own_entries_and_reports_those_a_peer_claimed(r):
    add_requests(r, 3)
    r.xreadgroup(messages.SCHEDULER_GROUP, "sched-a", {messages.REQUESTS: ">"}, count=3)
    ids = [e for e, _ in r.xrange(messages.REQUESTS)]
    claims = RequestClaims(r)
    claims.load()
    conn = redis_io.LoopConnection(r)
    r.xclaim(messages.REQUESTS, messages.SCHEDULER_GROUP, "sched-b", 0, [ids[1]], justid=True)  # a peer's
    r.xack(messages.REQUESTS, messages.SCHEDULER_GROUP, ids[2])  # finished
    lost = request_claims.parse_touch(conn.call(claims.touch_commands("sched-a", ids)))
    assert sorted(lost) == sorted(ids[1:])
    owners = {
        p["message_id"]: p["consumer"]
        for p in r.xpending_range(messages.REQUESTS, messages.SCHEDULER_GROUP, "-", "+", 10)
    }
    assert owners == {ids[0]: "sched-a", ids[1]: "sched-b"}  # the peer's entry was not taken back
    conn.close()


def test_a_stale_scheduler_acknowledges_only_the_entries_still_its_own(r):
    """A scheduler that stalled past its claim idle time and finishes a request a peer has taken over
    leaves the peer's entry pending (the peer's heartbeat would otherwise drop the request, and a
    peer dying next would leave nothing to claim); its own finished entries go."""
    add_requests(r, 2)
    r.xreadgroup(messages.SCHEDULER_GROUP, "sched-a", {messages.REQUESTS: ">"}, count=2)
    ids = [e for e, _ in r.xrange(messages.REQUESTS)]
    r.xclaim(messages.REQUESTS, messages.SCHEDULER_GROUP, "sched-b", 0, [ids[1]], justid=True)  # taken over
    stale = redis_io.LoopConnection(r, "sched-a")
    stale.publish({}, ids)  # sched-a finished both
    stale.flush()
    pending = r.xpending_range(messages.REQUESTS, messages.SCHEDULER_GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(ids[1], "sched-b")]
    assert [e for e, _ in r.xrange(messages.REQUESTS)] == ids[1:]  # its own: acknowledged and deleted
    stale.close()


@pytest.mark.parametrize(
    "reply",
    [
        ["0-0", [None, ["1-1", ["data", "x"]]], [0, 2]],  # Redis 6.2: nil in the deleted entry's place
        ["0-0", [["1-1", ["data", "x"]]], [2]],  # Redis 7: left out
    ],
)
def test_parse_claim_leaves_a_deleted_entry_out(reply):
    assert request_claims.parse_claim(reply) == ("0-0", [("1-1", {"data": "x"}, 2)])


def test_parse_claim_gives_an_entry_without_fields_empty_fields():
    reply = ["5-0", [["1-0", None], ["1-1", ["data", "x", "more", "y"]]], [2, 4]]
    assert request_claims.parse_claim(reply) == (
        "5-0",
        [("1-0", {}, 2), ("1-1", {"data": "x", "more": "y"}, 4)],
    )


def test_pack_commands_is_redis_py_packing(r):
    commands = [
        ("XADD", "s", "MAXLEN", "~", 100000, "*", "data", '{"é": 1}'),
        ("XACK", messages.REQUESTS, messages.SCHEDULER_GROUP, "1-1", "2-0"),
        ("SET", "k", b"\x00\xff", "EX", 10),
    ]
    conn = r.connection_pool.connection_class(**r.connection_pool.connection_kwargs)
    assert redis_io.pack_commands(commands) == b"".join(conn.pack_commands(commands))
