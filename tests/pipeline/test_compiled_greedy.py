"""Greedy output with the compiled forward (``services/worker/compiled_forward.py``) equals
``transformers.generate`` on the same weights (the near-tie rule, ``greedy_check``), as it does eagerly.

One tiny checkpoint per family; four prompts (3 to 40 tokens) under a 16-token budget, so passes mix
prompt chunks and decode tokens and include 1-token passes (padded to the compiled minimum). The
suite turns compilation off (``tests/conftest.py``); these tests turn it back on. All are ``slow``
(``./dev.sh test-slow``, which CI runs): even LLaMA alone took 45 s of the default run on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from greedy_check import assert_matches, hf_greedy
from pipeline_harness import wait_all_free
from tiny_models import tiny_checkpoint

NEW_TOKENS = 12
SLOW_FAMILIES = [
    "mistral-sw16",
    "opt-prenorm",
    "qwen2-bias",
    "qwen3-qknorm",
    "phi3-longrope-partial",
    "gemma2-sw16-softcap",
    "mixtral-top2of8",
    "qwen3moe-top3of8",
]


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv("FUSESERVE_COMPILE", "1")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) for n in ["llama-gqa", *SLOW_FAMILIES]]
)
def test_compiled_greedy_matches_transformers(name, tmp_path, compiling):
    import fuseserve

    hf, config = tiny_checkpoint(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 29, 40)]
    pipe = fuseserve.pipeline(
        str(tmp_path), token_budget=16, kv_cache_memory="8MiB", device="cpu", dtype="float32", progress=False
    )
    try:
        compiled = pipe.runner.compiled is not None
        outs = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0)
        wait_all_free(pipe)
    finally:
        pipe.close()
    if name.startswith(("mixtral", "qwen3moe")) and not compiled:
        pytest.xfail(f"{name}: the compiler did not take the model whole; it ran eagerly (logged)")
    assert compiled, "the forward must be compiled"
    assert sum(len(r.token_ids) for r in outs) > 2 * len(prompts), "guard: generation must not stop at once"
    for i, (ids, r) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches(r.token_ids, *hf_greedy(hf, ids, NEW_TOKENS), what=f"{name} compiled, prompt {i}")


@pytest.mark.slow
def test_smollm2_compiled_equals_eager(smollm2_source, monkeypatch):
    """SmolLM2: eight prompts, 24 greedy tokens, compiled and eager pipelines give the same tokens
    (a divergence only at a near-tie of the eager logits)."""
    from transformers import AutoModelForCausalLM

    import fuseserve

    tok = smollm2_source.load_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of"]
    prompts = [tok.encode(t) for t in texts] + [tok.encode(t * 6) for t in texts]
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FUSESERVE_COMPILE", flag)
        pipe = fuseserve.pipeline(
            str(smollm2_source.path),
            token_budget=64,
            kv_cache_memory="256MiB",
            dtype="float32",
            progress=False,
        )
        try:
            assert (pipe.runner.compiled is not None) == (flag == "1")
            outs[flag] = [r.token_ids for r in pipe(prompts, max_new_tokens=24, temperature=0.0)]
        finally:
            pipe.close()
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_source.path), dtype=torch.float32).eval()
    for i, ids in enumerate(prompts):
        if outs["1"][i] != outs["0"][i]:
            assert_matches(outs["1"][i], *hf_greedy(hf, ids, 24), what=f"SmolLM2 compiled, prompt {i}")
