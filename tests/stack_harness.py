"""Test helpers: a local stack (the code behind ``fuseserve serve``) on SmolLM2 with 2 CPU workers, and
what the stack tests ask of it (streams, schedulers' pending requests and stats)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

from fuseserve import messages
from fuseserve.redis_launcher import free_port

MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def local_stack(
    token_budget: int, kv_cache_memory: str, dtype: str | None = None, schedulers: int = 1, **options
) -> Iterator[tuple[object, str]]:
    """``fuseserve.serve`` with 2 CPU workers (1 thread each) and ``schedulers`` schedulers (``options``:
    more ``serve`` options, e.g. ``lora_modules``); yields ``(stack, base_url)``."""
    import fuseserve

    with fuseserve.serve(
        MODEL,
        workers=2,
        schedulers=schedulers,
        port=free_port(),
        token_budget=token_budget,
        kv_cache_memory=kv_cache_memory,
        device="cpu",
        dtype=dtype,
        threads=1,
        **options,
    ) as server:
        yield server.stack, server.url


RECOVERY = {"token_budget": 32, "kv_cache_memory": "64MiB", "dtype": "float32"}
"""``recovery_stack``'s settings: fp32, a small budget and KV pool."""


def recovery_stack(**kwargs):
    """``local_stack`` in fp32 with a small budget and KV pool, for tests that kill or drain a worker
    or a scheduler: a recompute or a takeover must reproduce greedy tokens exactly (bf16 matmuls may
    round differently for another batch shape). ``kwargs`` go to ``local_stack`` (``schedulers=2``)."""
    return local_stack(**RECOVERY, **kwargs)


def recovery_pipeline(source, **kwargs):
    """``fuseserve.pipeline`` on ``source`` (a ``ModelSource``) with ``recovery_stack``'s settings: the
    output a recovery stack must give. ``kwargs``: more pipeline keywords (``lora_modules``, ...)."""
    import fuseserve

    return fuseserve.pipeline(str(source.path), progress=False, **RECOVERY, **kwargs)


def openai_client(base: str, **kwargs):
    """The official ``openai`` client pointed at the stack (``api_key`` for a stack that needs one)."""
    import openai

    kwargs.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=f"{base}/v1", timeout=300, **kwargs)


def ask_streamed(
    client, prompt: str, max_tokens: int, progress: list | None = None, model: str = MODEL
) -> tuple[str, int]:
    """Stream one greedy completion of ``max_tokens`` tokens (EOS ignored) from ``model`` (a LoRA
    adapter's name, say); returns its text and the completion tokens counted by the usage chunk.
    ``progress``: a list each text chunk appends its arrival time to (``time.monotonic``)."""
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            if progress is not None:
                progress.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll ``predicate()`` every 20 ms until it returns something true; returns it. Raises
    ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def busiest_scheduler(stack) -> tuple[str, str]:
    """``(process name, consumer name)`` of the scheduler holding the most unfinished requests (its
    pending entries in the consumer group), once one holds some."""
    import redis

    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)

    def busiest():
        pending = r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)
        consumers = [c for c in pending["consumers"] if c["pending"] > 0]
        return max(consumers, key=lambda c: c["pending"])["name"] if consumers else None

    consumer = wait_for(busiest, what="a scheduler holding a request")
    pid = int(consumer.rsplit("-", 2)[1])  # consumer names are host-pid-suffix
    return next(name for name, p in stack.procs if p.pid == pid), consumer


def stats_of_live_schedulers(stack) -> list[dict]:
    """The stats each live scheduler wrote in the last seconds (``messages.scheduler_stats_key``)."""
    import redis

    r = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    out = []
    for key in r.scan_iter(match=f"{messages.SCHEDULER_STATS}:*"):
        raw = r.get(key)
        if raw:
            out.append(json.loads(raw))
    return out


def worker_record(stack, worker_id: str) -> messages.WorkerRecord | None:
    """``worker_id``'s record in Redis, or None once it is deregistered (or expired)."""
    import redis

    raw = redis.Redis.from_url(stack.redis.url).get(messages.worker_key(worker_id))
    return None if raw is None else messages.WorkerRecord.decode(raw)


def worker_num_running(stack, worker_id: str) -> int:
    """The sequences ``worker_id`` holds now, as its gRPC ``Health`` reports them."""
    import grpc

    from fuseserve.proto import worker_pb2 as pb
    from fuseserve.proto import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(worker_record(stack, worker_id).address) as channel:
        return pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10).num_running_seqs


def busiest_worker(stack, worker_ids: list[str]) -> tuple[str, int]:
    """``(worker id, sequences held)`` of the worker among ``worker_ids`` holding the most sequences,
    once one holds some (placement may put every sequence on one worker: which is not fixed)."""

    def busiest():
        held = {w: worker_num_running(stack, w) for w in worker_ids}
        name = max(held, key=held.get)
        return (name, held[name]) if held[name] else None

    return wait_for(busiest, 60, "a worker holding sequences")


def spawn_sim_worker(stack, options, index: int, slowdown: float) -> str:
    """Start one more simulated worker (``fuseserve worker --simulate``) in ``stack``, started from
    ``options`` (its ``ServeOptions``), as ``worker-{index}`` with ``slowdown``; returns its id (it
    registers on its own)."""
    import dataclasses

    from fuseserve.launcher import worker_argv

    worker_id = f"worker-{index}"
    opts = dataclasses.replace(options, simulate_slowdown=str(slowdown))
    stack.spawn(worker_id, worker_argv(opts, stack.redis.url, index, worker_id=worker_id))
    return worker_id


def proc_named(stack, name: str):
    """The child process called ``name`` (``stack.procs``)."""
    return next(p for n, p in stack.procs if n == name)
