"""Shared pytest fixtures."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

# Compilation (services/worker/compiled_forward.py) is off in tests, and in the processes they start,
# unless a test sets FUSESERVE_COMPILE=1 (tests/pipeline/test_compiled_greedy.py).
os.environ.setdefault("FUSESERVE_COMPILE", "0")

if not torch.cuda.is_available():
    # Triton kernels run interpreted without a GPU; the choice is made when triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_source():
    """SmolLM2-135M-Instruct as a ``ModelSource``, converted once into a cache kept between runs.

    The cache is ``$FUSESERVE_CACHE`` if set, else ``~/.cache/fuseserve``; the first run converts the
    bundled GGUF file (~40 s on 2 cores), later runs load it in about a second.
    """
    from fuseserve.model_source import resolve_model

    cache = os.environ.get("FUSESERVE_CACHE") or pathlib.Path.home() / ".cache" / "fuseserve"
    return resolve_model("smollm2-135m-instruct", cache_dir=cache)
