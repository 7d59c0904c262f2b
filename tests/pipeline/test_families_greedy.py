"""Greedy output of each newer family through the pipeline (16-token budget) equals
``transformers.generate`` on the same tiny random checkpoint, with the near-tie rule
(``greedy_check``).

Four prompts (3 to 40 tokens) run together, so with a 16-token budget long prompts are cut into
chunks and packed beside the others' decode tokens; each is compared with transformers run alone.
"""

from __future__ import annotations

import pytest
import torch
from greedy_check import assert_matches, hf_greedy
from pipeline_harness import wait_all_free
from tiny_models import NEW_FAMILIES, tiny_checkpoint

NEW_TOKENS = 12


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_pipeline_greedy_matches_transformers(name, tmp_path):
    import fuseserve

    hf, config = tiny_checkpoint(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 29, 40)]
    pipe = fuseserve.pipeline(
        str(tmp_path), token_budget=16, kv_cache_memory="8MiB", device="cpu", dtype="float32", progress=False
    )
    try:
        outs = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0)
        wait_all_free(pipe)  # frees ride on the worker's next plan
    finally:
        pipe.close()
    assert sum(len(r.token_ids) for r in outs) > 2 * len(prompts), "guard: generation must not stop at once"
    for i, (ids, r) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches(r.token_ids, *hf_greedy(hf, ids, NEW_TOKENS), what=f"{name} prompt {i}")
