"""Two schedulers over simulated workers (``fuseserve.serve(..., simulate=PRESET, schedulers=2)``):
control-plane behaviour, no model.

A scheduler whose only worker dies while it drives requests has no worker left (the peer holds the
other, its share): it hands its requests to the peer at once (``scheduler_drain.hand_over_waiting``)
instead of failing them with a 503 after ``NO_WORKER_GRACE_S``. Every stream completes with the
tokens of an undisturbed run, none twice.
"""

from __future__ import annotations

import concurrent.futures
import functools
import signal

import pytest
import redis
from stack_harness import MODEL, ask_streamed, openai_client, stats_of_live_schedulers, wait_for

from fuseserve import messages
from fuseserve.redis_launcher import free_port

NUM_STREAMS, NEW_TOKENS = 8, 200
PROMPTS = [f"Hand-over stream {i}:" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def server(smollm2_source):
    import fuseserve

    with fuseserve.serve(MODEL, workers=2, schedulers=2, port=free_port(), simulate="a100-llama2-7b") as s:
        yield s


def _holders(r) -> dict[str, str]:
    keys = list(r.scan_iter(match=messages.worker_lease_key("*")))
    return {k.rsplit(":", 1)[1]: v for k, v in zip(keys, r.mget(keys) if keys else [], strict=True) if v}


def _pending_of(r, consumer: str) -> int:
    pending = r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)
    return sum(c["pending"] for c in pending["consumers"] if c["name"] == consumer)


def test_a_scheduler_left_with_no_worker_hands_its_requests_to_the_peer(server):
    r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
    client = openai_client(server.url, max_retries=0)
    ask = functools.partial(ask_streamed, client, max_tokens=NEW_TOKENS)
    wait_for(lambda: len(set(_holders(r).values())) == 2, 60, "each scheduler holding a worker")
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        baseline = list(ex.map(ask, PROMPTS))
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        futures = [ex.submit(ask, p, progress=progress) for p in PROMPTS]
        victim = _holders(r)["worker-1"]
        wait_for(
            lambda: len(progress) >= NUM_STREAMS and _pending_of(r, victim), 60, "worker-1's scheduler busy"
        )
        worker = next(p for name, p in server.stack.procs if name == "worker-1")
        worker.send_signal(signal.SIGKILL)  # not restarted: nothing supervises the stack here
        worker.wait()
        assert any(not f.done() for f in futures), "the kill came after every stream had finished"
        got = [f.result(timeout=120) for f in futures]  # an error (a 503) would raise here
    assert got == baseline
    handed = wait_for(
        lambda: sum(s.get("handed_over", 0) for s in stats_of_live_schedulers(server.stack)),
        30,
        "the hand-over in the schedulers' stats",
    )
    print(f"\nhanded over: {handed} requests from the scheduler left without a worker")
