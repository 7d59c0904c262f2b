"""Test helper: a local stack (the code behind ``fuseserve serve``) on SmolLM2 with 2 CPU workers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fuseserve.redis_launcher import free_port

MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def local_stack(
    token_budget: int, kv_cache_memory: str, dtype: str | None = None
) -> Iterator[tuple[object, str]]:
    """``fuseserve.serve`` with 2 CPU workers (1 thread each); yields ``(stack, base_url)``."""
    import fuseserve

    with fuseserve.serve(
        MODEL,
        workers=2,
        port=free_port(),
        token_budget=token_budget,
        kv_cache_memory=kv_cache_memory,
        device="cpu",
        dtype=dtype,
        threads=1,
    ) as server:
        yield server.stack, server.url


def recovery_stack():
    """``local_stack`` in fp32 with a small budget and KV pool, for tests that kill a worker: a
    recompute on the other worker must reproduce greedy tokens exactly (bf16 matmuls may round
    differently for another batch shape)."""
    return local_stack(token_budget=32, kv_cache_memory="64MiB", dtype="float32")


def openai_client(base: str, **kwargs):
    """The official ``openai`` client pointed at the stack."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, **kwargs)
