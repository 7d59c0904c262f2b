"""A stack whose worker runs as 3 tensor-parallel ranks (gloo, CPU; SmolLM2's 9 heads and 3 KV heads
split in 3, 2 would not divide them) serves the ``openai`` client, and killing one of its ranks under
load fails no request: the worker stops and its sequences are recomputed on another worker."""

from __future__ import annotations

import concurrent.futures
import pathlib

import pytest
from stack_harness import MODEL, openai_client

from fuseserve.redis_launcher import free_port

NEW_TOKENS = 40
PROMPTS = [f"Tell me about the number {i}." for i in range(6)]


@pytest.fixture(scope="module")
def stack(smollm2_source):
    import fuseserve

    with fuseserve.serve(
        MODEL,
        workers=1,
        port=free_port(),
        token_budget=32,
        kv_cache_memory="64MiB",
        device="cpu",
        threads=1,
        tensor_parallel_size=3,
        dtype="float32",  # exact text: in bf16 the answer's first token ties ("The" / "L", 1 step apart)
    ) as server:
        yield server.stack, server.url


def test_tp_worker_serves_openai_client(stack):
    client = openai_client(stack[1], max_retries=0)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert r.choices[0].message.content == "The capital of France is Paris."


def _follower_pids(pid: int) -> list[int]:
    """Processes started by ``pid`` through multiprocessing's spawn (its tensor-parallel ranks)."""
    found = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (p / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            found.append(int(p.name))
    return found


def test_killed_rank_fails_no_request(stack):
    import os
    import signal

    from fuseserve.launcher import wait_healthy

    s, url = stack
    tp_worker = next(p for n, p in s.procs if n == "worker-0")
    ranks = _follower_pids(tp_worker.pid)
    assert len(ranks) == 2, ranks
    s.spawn(
        "worker-plain",
        [
            "--log-level",
            "WARNING",
            "worker",
            "--redis-url",
            s.redis.url,
            "--model",
            MODEL,
            "--host",
            "127.0.0.1",
        ]
        + ["--port", "0", "--threads", "1", "--worker-id", "worker-plain", "--token-budget", "32"]
        + ["--kv-cache-memory", "64MiB", "--device", "cpu"],
    )
    wait_healthy(s, url, 2)
    client = openai_client(url, max_retries=0)

    def ask(prompt):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        futures = [ex.submit(ask, p) for p in PROMPTS]
        stream = client.completions.create(
            model=MODEL, prompt="Count slowly:", max_tokens=8, temperature=0, stream=True
        )
        for _ in stream:  # generation is under way
            break
        stream.close()
        os.kill(ranks[0], signal.SIGKILL)
        assert any(not f.done() for f in futures), "the kill came after every request had finished"
        assert [f.result(timeout=240) for f in futures] == [NEW_TOKENS] * len(PROMPTS)
    assert tp_worker.wait(timeout=30) == 3  # the rank's death took its worker down
