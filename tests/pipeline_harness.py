"""Helpers shared by the pipeline tests (``tests/pipeline/``); their fixtures are in its ``conftest.py``."""

from __future__ import annotations

import threading
import time

TIMEOUT = 120  # seconds; a request that takes longer counts as hung
BYTES_PER_BLOCK = 30 * 16 * 3 * 64 * 2 * 4  # layers x block tokens x kv heads x head dim x (K, V) x fp32
TINY_BLOCKS = 10


def pipelines(request, overlap: bool):
    """``(pipe, tiny)`` with overlap on or off."""
    if overlap:
        return request.getfixturevalue("pipe"), request.getfixturevalue("tiny")
    return request.getfixturevalue("pipe_serial"), request.getfixturevalue("tiny_serial")


def chat(pipe, text: str) -> list[int]:
    return pipe.chat_prompt_ids([{"role": "user", "content": text}])


def in_thread(fn, timeout: float = TIMEOUT):
    """Run ``fn()`` in a thread; return its result or re-raise its exception; fail if it hangs."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_concurrently(fns, timeout: float = TIMEOUT) -> list:
    """Start every ``fn`` at the same moment in its own thread; results in order."""
    barrier = threading.Barrier(len(fns))
    results: list = [None] * len(fns)
    errors: list = []

    def target(i, fn):
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "concurrent calls hung"
    assert not errors, errors
    return results


def wait_all_free(p, timeout: float = 10.0) -> None:
    """Every KV block is free again, in the worker and in the scheduler's accounting."""
    account = p.scheduler.slots["local"].account
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.runner.num_free_blocks == p.runner.info.num_blocks and account.num_free == account.num_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"blocks not freed: worker {p.runner.num_free_blocks}/{p.runner.info.num_blocks}, "
        f"scheduler {account.num_free}/{account.num_blocks}"
    )
