"""Fixtures of the stack tests: one local stack per test module, and a pipeline with its settings."""

from __future__ import annotations

import pytest
from stack_harness import local_stack


@pytest.fixture(scope="module")
def stack(smollm2_source):
    """The stack of a test module (fp32, budget 64): ``(stack, base_url)``."""
    with local_stack(token_budget=64, kv_cache_memory="128MiB", dtype="float32") as s:
        yield s


@pytest.fixture(scope="module")
def pipe(smollm2_source):
    """The pipeline with the stack's settings (fp32, budget 64), to compare with it."""
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path), token_budget=64, kv_cache_memory="128MiB", dtype="float32", progress=False
    )
    yield p
    p.close()
