"""Test helper: a local stack (the code behind ``fuseserve serve``) on SmolLM2 with 2 CPU workers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

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


def openai_client(base: str, **kwargs):
    """The official ``openai`` client pointed at the stack."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, **kwargs)


@pytest.fixture(scope="module")
def stack(smollm2_source):
    """The stack of a test module (fp32, budget 64): ``(stack, base_url)``; import it by name."""
    with local_stack(token_budget=64, kv_cache_memory="128MiB", dtype="float32") as s:
        yield s


@pytest.fixture(scope="module")
def pipe(smollm2_source):
    """The pipeline with the stack's settings (fp32, budget 64), to compare with it; import it by name."""
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path), token_budget=64, kv_cache_memory="128MiB", dtype="float32", progress=False
    )
    yield p
    p.close()
