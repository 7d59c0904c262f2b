"""Graceful drain of a worker (SIGTERM) in the local stack on SmolLM2: while 8 streams run, the worker
announces it is draining, its scheduler places nothing new on it, its sequences finish there, and it
deregisters and exits 0. Every stream ends with the text of an undisturbed run, with no 5xx (the
client does not retry) and every token counted once.
"""

from __future__ import annotations

import concurrent.futures
import signal

import pytest
from stack_harness import (
    ask_streamed,
    local_stack,
    openai_client,
    proc_named,
    wait_for,
    worker_num_running,
    worker_record,
)

NUM_STREAMS = 8
NEW_TOKENS = 24
PROMPTS = [f"Name a fact about the number {i}." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    # fp32: the text is compared exactly with an undisturbed run
    with local_stack(token_budget=32, kv_cache_memory="64MiB", dtype="float32") as s:
        yield s


def run_streams(client, progress=None) -> list[concurrent.futures.Future]:
    ex = concurrent.futures.ThreadPoolExecutor(NUM_STREAMS)
    futures = [ex.submit(ask_streamed, client, p, NEW_TOKENS, progress) for p in PROMPTS]
    ex.shutdown(wait=False)
    return futures


def test_sigterm_worker_finishes_its_streams_deregisters_and_exits_0(stack):
    stack, url = stack
    client = openai_client(url, max_retries=0)  # a 5xx raises instead of being retried
    baseline = [f.result(timeout=300) for f in run_streams(client)]
    assert all(n == NEW_TOKENS for _, n in baseline)

    progress: list = []
    futures = run_streams(client, progress)
    wait_for(lambda: len(progress) >= NUM_STREAMS and worker_num_running(stack, "worker-0") > 0, 120)
    worker = proc_named(stack, "worker-0")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: getattr(worker_record(stack, "worker-0"), "draining", True), what="the drain notice")
    assert any(not f.done() for f in futures), "the drain came after every stream had finished"
    assert worker.wait(timeout=120) == 0
    stack.procs.remove(("worker-0", worker))  # stopped on purpose: the stack must not count it
    assert worker_record(stack, "worker-0") is None  # deregistered
    got = [f.result(timeout=300) for f in futures]
    assert got == baseline  # no token lost or repeated; usage counts each once
