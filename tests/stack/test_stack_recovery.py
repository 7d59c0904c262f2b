"""Reliability of the persistent stack: nothing is lost when a worker or the scheduler dies mid-run.

A killed worker's sequences are recomputed on the other worker; a restarted scheduler re-claims the
unfinished requests from the Redis consumer group and the gateway drops the tokens it already sent.
Greedy outputs are identical to an undisturbed run.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest
from stack_harness import MODEL, openai_client, recovery_stack

PROMPTS = [f"Tell me about the number {i}." for i in range(4)]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def stack(smollm2_source):
    with recovery_stack() as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack[1], max_retries=0)


def ask(client, prompt):
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text, r.usage.completion_tokens


@pytest.fixture(scope="module")
def baseline(client):
    return [ask(client, p) for p in PROMPTS]


def run_with_disruption(client, disrupt) -> list:
    """Start the four requests, wait until tokens flow, call ``disrupt()``, return the results."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as ex:
        futures = [ex.submit(ask, client, p) for p in PROMPTS]
        # a streamed probe tells us generation is under way
        stream = client.completions.create(
            model=MODEL,
            prompt="Count slowly:",
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        in_flight = sum(not f.done() for f in futures)
        disrupt()
        assert in_flight > 0, "the disruption came after every request had finished"
        return [f.result(timeout=240) for f in futures]


def proc(stack, name):
    return next(p for n, p in stack[0].procs if n == name)


def test_killed_worker_sequences_finish_elsewhere(stack, client, baseline):
    got = run_with_disruption(client, lambda: proc(stack, "worker-0").send_signal(signal.SIGKILL))
    assert got == baseline
    assert all(n == NEW_TOKENS for _, n in got)


def test_restarted_scheduler_reclaims_unfinished_requests(stack, client, baseline):
    def restart():
        old = proc(stack, "scheduler")
        old.send_signal(signal.SIGKILL)
        old.wait()
        stack[0].procs.remove(("scheduler", old))
        time.sleep(0.5)
        stack[0].spawn(
            "scheduler",
            [
                "--log-level",
                "WARNING",
                "scheduler",
                "--redis-url",
                stack[0].redis.url,
                "--token-budget",
                "32",
            ],
        )

    got = run_with_disruption(client, restart)
    assert got == baseline
