"""Fixtures of the pipeline tests: SmolLM2 pipelines built once per test module, closed at its end.

The pipelines run in fp32 (``--dtype auto`` would pick bf16 on CPUs with bf16 instructions), so the
exact-output checks and the KV block arithmetic hold on every machine.
"""

from __future__ import annotations

import pytest
from pipeline_harness import BYTES_PER_BLOCK, TINY_BLOCKS


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
