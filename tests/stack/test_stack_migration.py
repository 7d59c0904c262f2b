"""KV migration on drain with the real model: SmolLM2 in fp32, one scheduler, two CPU workers. A worker
told SIGTERM mid-decode moves its decoding sequences, with their K/V, to the other worker: every
stream ends with the text of an undisturbed run (greedy), no computed token is given up
(``recomputed_tokens`` 0), and the worker exits 0 without waiting for its streams to end.
``benchmarks/migration.py`` measures the same with 2k-token prompts against the recompute path."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest
from stack_harness import (
    ask_streamed,
    busiest_worker,
    openai_client,
    proc_named,
    recovery_stack,
    stats_of_live_schedulers,
    wait_for,
)

NUM_STREAMS, NEW_TOKENS = 6, 120  # long enough to outlast the drain on a loaded host
PROMPTS = [f"Tell me something about the number {i}, in one long sentence." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    with recovery_stack() as s:
        yield s


def test_a_draining_worker_moves_its_sequences_with_their_kv(stack):
    stack, url = stack
    client = openai_client(url, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        baseline = list(ex.map(lambda p: ask_streamed(client, p, NEW_TOKENS), PROMPTS))
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        futures = [ex.submit(ask_streamed, client, p, NEW_TOKENS, progress) for p in PROMPTS]
        wait_for(lambda: len(progress) >= 2 * NUM_STREAMS, 120, "every stream decoding")
        victim, held = busiest_worker(stack, ["worker-0", "worker-1"])
        worker = proc_named(stack, victim)
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        exit_s = time.monotonic() - t0
        stack.procs.remove((victim, worker))  # stopped on purpose: the stack must not count it
        assert any(not f.done() for f in futures), "the streams ended before the worker did"
        got = [f.result(timeout=300) for f in futures]
    assert got == baseline  # the moved streams decode on from their K/V: same greedy text
    stats = wait_for(lambda: [s for s in stats_of_live_schedulers(stack) if s.get("migrated")], 30, "stats")
    assert stats[0]["recomputed_tokens"] == 0 and stats[0]["migrated_bytes"] > 0
    print(
        f"\nmigration: {stats[0]['migrated']} of {held} sequences moved off {victim} "
        f"({stats[0]['migrated_bytes'] / 1e6:.1f} MB), worker exited {exit_s:.2f} s after SIGTERM"
    )
