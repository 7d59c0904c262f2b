"""Graceful drain (SIGTERM) in the local stack on SmolLM2 (fp32: text compared exactly), with 2
workers and 2 schedulers. Each test disturbs a run of 8 streams; every stream must end with the text
of an undisturbed run, with no 5xx (the client does not retry) and every token counted once.

- A worker told SIGTERM announces it is draining, its scheduler places nothing new on it, its
  sequences finish there, and it deregisters and exits 0.
- A scheduler told SIGTERM while it holds requests hands them and its workers to the other scheduler
  at once and exits 0: at its exit its worker leases are gone (released, not left to expire) and its
  pending requests are claimable (idle past ``CLAIM_IDLE_MS``) or already claimed, so the takeover
  waits for neither the lease TTL nor the claim idle time.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest
import redis
from stack_harness import (
    ask_streamed,
    busiest_scheduler,
    busiest_worker,
    openai_client,
    proc_named,
    recovery_stack,
    stats_of_live_schedulers,
    wait_for,
    worker_num_running,
    worker_record,
)

from fuseserve import messages

NUM_STREAMS = 8
NEW_TOKENS = 24
PROMPTS = [f"Name a fact about the number {i}." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    with recovery_stack(schedulers=2) as s:
        yield s


@pytest.fixture(scope="module")
def baseline(stack):
    client = openai_client(stack[1], max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        out = list(ex.map(lambda p: ask_streamed(client, p, NEW_TOKENS), PROMPTS))
    assert all(n == NEW_TOKENS for _, n in out)
    return out


def disrupted(url: str, disrupt, ready=lambda: True) -> list[tuple[str, int]]:
    """Run the 8 streams; once each has a token and ``ready()``, call ``disrupt()``; return the
    results (a 5xx raises)."""
    client = openai_client(url, max_retries=0)
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        futures = [ex.submit(ask_streamed, client, p, NEW_TOKENS, progress) for p in PROMPTS]
        wait_for(lambda: len(progress) >= NUM_STREAMS and ready(), timeout=120, what="tokens flowing")
        in_flight = sum(not f.done() for f in futures)
        disrupt()
        assert in_flight, "the disruption came after every stream had finished"
        return [f.result(timeout=300) for f in futures]


def test_sigterm_worker_finishes_its_streams_deregisters_and_exits_0(stack, baseline):
    stack, url = stack
    workers = ["worker-0", "worker-1"]

    def drain_worker():
        name, _ = busiest_worker(stack, workers)  # placement may put every stream on one worker
        worker = proc_named(stack, name)
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        wait_for(lambda: getattr(worker_record(stack, name), "draining", True), what="the drain notice")
        assert worker.wait(timeout=120) == 0
        print(f"\nworker drain: {name} exit 0 {time.monotonic() - t0:.2f} s after SIGTERM")
        stack.procs.remove((name, worker))  # stopped on purpose: the stack must not count it
        assert worker_record(stack, name) is None  # deregistered

    got = disrupted(url, drain_worker, ready=lambda: any(worker_num_running(stack, w) for w in workers))
    assert got == baseline  # no token lost or repeated; usage counts each once


def test_sigterm_scheduler_hands_requests_and_workers_over_at_once(stack, baseline):
    stack, url = stack
    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    victim: dict = {}

    def drain_scheduler():
        name, consumer = busiest_scheduler(stack)
        proc = proc_named(stack, name)
        victim.update(consumer=consumer, pid=proc.pid, t0=time.monotonic())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        victim["exit_s"] = time.monotonic() - victim["t0"]
        stack.procs.remove((name, proc))  # stopped on purpose
        # at its exit: no lease of it left to expire, its unfinished requests claimable now
        leases = [r.get(k) for k in r.scan_iter(match=messages.worker_lease_key("*"))]
        assert consumer not in leases
        pending = r.xpending_range(
            messages.REQUESTS, messages.SCHEDULER_GROUP, "-", "+", 1000, consumername=consumer
        )
        victim["pending"] = len(pending)
        assert all(p["time_since_delivered"] >= messages.CLAIM_IDLE_MS for p in pending)
        assert r.get(messages.scheduler_live_key(consumer)) is None
        t_exit = time.monotonic()
        mine = lambda: r.xpending_range(  # noqa: E731
            messages.REQUESTS, messages.SCHEDULER_GROUP, "-", "+", 1000, consumername=consumer
        )
        wait_for(lambda: not mine(), what="the other scheduler claiming the requests")
        victim["claimed_s"] = time.monotonic() - t_exit

    got = disrupted(url, drain_scheduler)
    done_s = time.monotonic() - victim["t0"]
    assert got == baseline  # nothing lost, no token twice; usage counts each once
    others = lambda: [s for s in stats_of_live_schedulers(stack) if s["pid"] != victim["pid"]]  # noqa: E731
    taken = wait_for(lambda: sum(s.get("taken_over", 0) for s in others()), what="the takeover in the stats")
    print(
        f"\nscheduler drain: exit {victim['exit_s']:.2f} s after SIGTERM ({victim['pending']} requests "
        f"still pending under it, all claimed {victim['claimed_s']:.2f} s after its exit), {taken} taken over, "
        f"all done {done_s:.2f} s after SIGTERM "
        f"(lease TTL {messages.LEASE_TTL_S:g} s, claim idle {messages.CLAIM_IDLE_MS / 1000:g} s)"
    )
