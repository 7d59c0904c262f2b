"""KV migration on drain, control plane only: a simulated stack (``fuseserve.serve(...,
simulate=PRESET)``, one scheduler, two workers). A worker told SIGTERM mid-decode has its decoding
sequences moved to the other worker (``--migration drain``, the default) instead of finishing them:
every stream ends with the tokens of an undisturbed run, none is recomputed, and the drained worker
exits at once, long before its sequences would have ended."""

from __future__ import annotations

import concurrent.futures
import functools
import signal
import time

import pytest
from stack_harness import (
    MODEL,
    ask_streamed,
    busiest_worker,
    openai_client,
    stats_of_live_schedulers,
    wait_for,
)

from fuseserve.redis_launcher import free_port

NUM_STREAMS, NEW_TOKENS = 8, 400
PROMPTS = [f"Migration stream {i}:" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def server(smollm2_source):
    import fuseserve

    with fuseserve.serve(MODEL, workers=2, port=free_port(), simulate="a100-llama2-7b") as s:
        yield s


def test_a_draining_worker_hands_its_sequences_over_with_their_kv(server):
    client = openai_client(server.url, max_retries=0)
    ask = functools.partial(ask_streamed, client, max_tokens=NEW_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        baseline = list(ex.map(ask, PROMPTS))
    progress: list = []
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as ex:
        futures = [ex.submit(ask, p, progress=progress) for p in PROMPTS]
        wait_for(lambda: len(progress) >= 2 * NUM_STREAMS, 60, "every stream decoding")
        victim, moving = busiest_worker(server.stack, ["worker-0", "worker-1"])
        worker = next(p for name, p in server.stack.procs if name == victim)
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        exit_s = time.monotonic() - t0
        assert any(not f.done() for f in futures), "the streams ended before the worker did"
        got = [f.result(timeout=120) for f in futures]
    assert got == baseline
    stats = wait_for(
        lambda: [s for s in stats_of_live_schedulers(server.stack) if s.get("migrated")], 30, "stats"
    )
    assert stats[0]["migrated"] >= 1 and stats[0]["recomputed_tokens"] == 0
    print(
        f"\nmigration: {stats[0]['migrated']} of {moving} sequences moved off {victim}, which exited {exit_s:.2f} s after SIGTERM"
    )
