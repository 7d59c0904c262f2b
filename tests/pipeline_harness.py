"""Fixtures and helpers shared by ``test_pipeline.py`` and ``test_pipeline_errors.py``.

The pipelines run in fp32 (``--dtype auto`` would pick bf16 on CPUs with bf16 instructions), so the
exact-output checks and the KV block arithmetic below hold on every machine.

``pipe`` and ``tiny`` are module-scoped: each test module that imports them by name builds its own
pipelines once and closes them at its end.
"""

from __future__ import annotations

import threading
import time

import pytest

TIMEOUT = 120  # seconds; a request that takes longer counts as hung
BYTES_PER_BLOCK = 30 * 16 * 3 * 64 * 2 * 4  # layers x block tokens x kv heads x head dim x (K, V) x fp32
TINY_BLOCKS = 10


def _pipe(source, overlap: bool):
    import fuseserve

    return fuseserve.pipeline(
        str(source.path),
        token_budget=64,
        kv_cache_memory="256MiB",
        dtype="float32",
        progress=False,
        overlap=overlap,
    )


def _tiny(source, overlap: bool):
    import fuseserve

    p = fuseserve.pipeline(
        str(source.path),
        token_budget=64,
        kv_cache_memory=TINY_BLOCKS * BYTES_PER_BLOCK,
        dtype="float32",
        progress=False,
        overlap=overlap,
        # the pool must overflow whenever these tests send their handful of requests: with prefix
        # caching, requests sharing the chat template's blocks need fewer of them, and whether they
        # share depends on arrival timing (preemption while sharing: test_prefix_cache_greedy.py)
        prefix_caching=False,
    )
    assert p.runner.info.num_blocks == TINY_BLOCKS
    return p


def _module_pipeline(name: str, make, overlap: bool, doc: str):
    """A module-scoped fixture ``name`` yielding ``make(source, overlap)``, closed at the module's end."""

    @pytest.fixture(scope="module", name=name)
    def fixture(smollm2_source):
        p = make(smollm2_source, overlap)
        yield p
        p.close()

    fixture.__doc__ = doc
    return fixture


pipe = _module_pipeline("pipe", _pipe, True, "The pipeline as it ships: overlap on.")
tiny = _module_pipeline(
    "tiny",
    _tiny,
    True,
    "The same model with a KV pool of 10 blocks (160 tokens), prefix caching off: a handful of\n    requests overflow it.",
)
pipe_serial = _module_pipeline("pipe_serial", _pipe, False, "``pipe`` with overlap off: one plan at a time.")
tiny_serial = _module_pipeline("tiny_serial", _tiny, False, "``tiny`` with overlap off.")


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
