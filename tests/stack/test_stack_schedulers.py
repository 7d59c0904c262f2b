"""Several schedulers: one stalled past its lease (SIGSTOP) or killed (SIGKILL) mid-run; a live one
takes over its workers (after their leases expire) and its pending requests (XAUTOCLAIM); every
request completes with the text of an undisturbed run and no token reaches a client twice. The
stalled one, continued, acts on nothing: it drops the requests the peer took instead of taking them
back, and any plan it still sends is refused by fence (counted by the workers; whether it sends one
before its heartbeat notices the lost lease is a race here, so ``test_scheduler_fencing.py`` drives
that interleaving by hand).
"""

from __future__ import annotations

import concurrent.futures
import functools
import signal

import grpc
import pytest
import redis
from stack_harness import (
    ask_streamed,
    busiest_scheduler,
    openai_client,
    recovery_stack,
    stats_of_live_schedulers,
    wait_for,
)

from fuseserve import messages
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc

NUM_REQUESTS = 16
NEW_TOKENS = 24
PROMPTS = [f"Write a sentence about the number {i}." for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    with recovery_stack(schedulers=2) as s:
        yield s


ask = functools.partial(ask_streamed, max_tokens=NEW_TOKENS)


def _fenced_refusals(stack) -> int:
    """Plans and frees the workers refused for a stale fence (their gRPC ``Health``)."""
    r = redis.Redis.from_url(stack.redis.url)
    total = 0
    for key in r.scan_iter(match=f"{messages.WORKER_PREFIX}*"):
        rec = messages.WorkerRecord.decode(r.get(key))
        with grpc.insecure_channel(rec.address) as channel:
            total += pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10).num_fenced
    return total


@pytest.mark.slow
def test_a_stalled_scheduler_continued_after_a_takeover_acts_on_nothing(stack):
    """Split brain: SIGSTOP the busiest scheduler past its lease; the peer takes its worker and its
    requests over and finishes them; SIGCONT. Every text equals an undisturbed run's, no token twice,
    and the stalled one drops what the peer took."""
    stack, url = stack
    client = openai_client(url, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as ex:
        baseline = list(ex.map(lambda p: ask(client, p), PROMPTS))
    refused_before = _fenced_refusals(stack)
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as ex:
        futures = [ex.submit(ask, client, p, progress=progress) for p in PROMPTS]
        victim, _ = busiest_scheduler(stack)
        wait_for(lambda: progress, 120, "tokens flowing")
        proc = next(p for name, p in stack.procs if name == victim)
        proc.send_signal(signal.SIGSTOP)
        try:
            assert any(not f.done() for f in futures), "the stop came after every request had finished"
            got = [f.result(timeout=300) for f in futures]  # the peer finishes them all
            peer = [s for s in stats_of_live_schedulers(stack) if s["pid"] != proc.pid]
            assert sum(s.get("taken_over", 0) for s in peer) > 0
        finally:
            proc.send_signal(signal.SIGCONT)
    assert got == baseline
    mine = wait_for(
        lambda: [s for s in stats_of_live_schedulers(stack) if s["pid"] == proc.pid and s["lost_to_peers"]],
        60,
        "the continued scheduler dropping the requests the peer took",
    )
    again = [ask(client, p) for p in PROMPTS[:2]]  # both serve on afterwards
    assert again == baseline[:2]
    print(
        f"\nsplit brain: {mine[0]['lost_to_peers']} requests dropped by the continued scheduler, "
        f"{_fenced_refusals(stack) - refused_before} of its plans refused by fence"
    )


@pytest.mark.slow
def test_killed_scheduler_workers_and_requests_taken_over(stack):
    stack, url = stack
    client = openai_client(url, max_retries=0)
    assert sum(1 for name, _ in stack.procs if name.startswith("scheduler")) == 2
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as ex:
        baseline = list(ex.map(lambda p: ask(client, p), PROMPTS))
    assert all(n == NEW_TOKENS for _, n in baseline)
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as ex:
        futures = [ex.submit(ask, client, p, progress=progress) for p in PROMPTS]
        victim, _ = busiest_scheduler(stack)
        wait_for(lambda: progress, 120, "tokens flowing")
        proc = next(p for name, p in stack.procs if name == victim)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stack.procs.remove((victim, proc))  # the stack's supervisor must not count it as a crash
        assert any(not f.done() for f in futures), "the kill came after every request had finished"
        got = [f.result(timeout=300) for f in futures]
    # identical text: no token lost, none repeated (a token sent twice would show in the text);
    # usage counts every token once
    assert got == baseline
    wait_for(  # the stats are written once a second
        lambda: sum(s.get("taken_over", 0) for s in stats_of_live_schedulers(stack) if s["pid"] != proc.pid),
        60,
        "the takeover in the live scheduler's stats",
    )
