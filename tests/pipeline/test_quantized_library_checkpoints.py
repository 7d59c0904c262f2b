"""Checkpoints made by llm-compressor itself (``benchmarks/quantized_library_checkpoints.py``, run in
a venv of its own) against ``transformers``' logits on them (compressed-tensors decompressing).

Runs where ``FUSESERVE_QUANT_LIBRARY_CHECKPOINTS`` names the folder that script wrote; skipped
elsewhere (llm-compressor is not a fuseserve dependency). fuseserve runs each in fp32 with the
prompts in chunks of 16 tokens packed together; logits within 1e-3 of the largest reference logit.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from engine_driver import chunked_logits

from fuseserve.config import EngineConfig
from fuseserve.model_source import resolve_model
from fuseserve.worker.model_runner import ModelRunner

ROOT = os.environ.get("FUSESERVE_QUANT_LIBRARY_CHECKPOINTS")
CHECKPOINTS = sorted(p.parent.name for p in pathlib.Path(ROOT).glob("*/reference_logits.pt")) if ROOT else []

pytestmark = pytest.mark.skipif(not CHECKPOINTS, reason="FUSESERVE_QUANT_LIBRARY_CHECKPOINTS not set")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_library_checkpoint_matches_transformers(name):
    path = pathlib.Path(ROOT) / name
    ref = torch.load(path / "reference_logits.pt")
    source = resolve_model(path)
    engine = EngineConfig(kv_cache_memory="16MiB", block_size=16, device="cpu", dtype="float32")
    runner = ModelRunner(path, source.config, eos_token_ids=[0], config=engine, progress=False)
    assert any(hasattr(m, "packed") for m in runner.model.modules())
    prompts = dict(enumerate(ref["prompts"]))
    ours = chunked_logits(runner, prompts, dict.fromkeys(prompts, 16))
    worst = max(
        ((ours[i] - want).abs().max() / want.abs().max()).item() for i, want in enumerate(ref["logits"])
    )
    print(f"\n{name}: max |fuseserve - transformers| / max |logit| = {worst:.2e}")
    assert worst <= 1e-3
