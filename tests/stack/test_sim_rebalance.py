"""Rebalancing by KV migration (``--migration balance``) on a real stack of simulated workers: a
burst lands on a 3x-slower worker alone, then a fast worker joins; the scheduler moves sequences to
it with their K/V (none recomputed) and every stream ends with the tokens of the run on the slow
worker alone. ``benchmarks/rebalance.py`` measures the time it saves against ``off``."""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
from stack_harness import (
    MODEL,
    ask_streamed,
    openai_client,
    spawn_sim_worker,
    stats_of_live_schedulers,
    wait_for,
    worker_num_running,
    worker_record,
)

from fuseserve.cli import serve_args
from fuseserve.launcher import start_stack
from fuseserve.redis_launcher import free_port

NUM_STREAMS, NEW_TOKENS = 8, 300
PROMPTS = [f"Rebalanced stream {i}:" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    options = serve_args(
        model=MODEL,
        workers=1,
        port=free_port(),
        simulate="a100-llama2-7b",
        simulate_slowdown="3",
        migration="balance",
    )
    stack, url = start_stack(options)
    try:
        yield stack, url, options
    finally:
        stack.stop()


def test_sequences_move_to_a_fast_worker_that_joins(stack):
    stack, url, options = stack
    client = openai_client(url, max_retries=0)
    ask = functools.partial(ask_streamed, client, max_tokens=NEW_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        alone = list(ex.map(ask, PROMPTS))  # on the slow worker alone
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        futures = [ex.submit(ask, p, progress=progress) for p in PROMPTS]
        wait_for(lambda: worker_num_running(stack, "worker-0") == NUM_STREAMS, 60, "the burst on worker-0")
        wait_for(lambda: len(progress) >= NUM_STREAMS, 60, "the streams decoding")
        spawn_sim_worker(stack, options, 1, 1.0)
        wait_for(lambda: worker_record(stack, "worker-1"), 60, "worker-1 registered")
        assert any(not f.done() for f in futures), "the streams ended before the fast worker joined"
        got = [f.result(timeout=120) for f in futures]
    assert got == alone  # moved with their state: the same tokens
    stats = wait_for(
        lambda: [s for s in stats_of_live_schedulers(stack) if s.get("rebalanced")], 30, "a rebalancing"
    )[0]
    assert stats["rebalanced"] >= 1 and stats["recomputed_tokens"] == 0
    assert stats["workers"]["worker-1"]["admitted"] >= stats["rebalanced"]
    print(f"\nrebalance: {stats['rebalanced']} of {NUM_STREAMS} sequences moved to the worker that joined")
