"""SmolLM2-135M-Instruct (the real model): greedy tokens equal ``transformers.generate``.

Prompts run alone and all eight together, with token budgets 16, 64, 128 and 256 (so prompts are
split into chunks of those sizes and packed beside each other's decode tokens). Both dtypes run:
fuseserve in fp32 against ``transformers`` in fp32, and fuseserve in bf16 against ``transformers`` in
bf16. Rounding may flip a near-tie: a divergence is accepted only where transformers' two candidate
logits at that step are within ``tie_bound`` of each other (fp32: less than 1e-3; bf16: equal or
adjacent bf16 values, i.e. at most one bf16 step at their magnitude, 0.125 for logits in [16, 32)
where SmolLM2's top logits lie), and the test checks exactly that.
"""

from __future__ import annotations

import pytest
import torch
from greedy_check import assert_matches, hf_greedy
from pipeline_harness import wait_all_free

NEW_TOKENS = 32

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
]
PLAIN = [
    "Hello",  # ~1-5 tokens
    "The quick brown fox jumps over the lazy dog. Then the dog",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
LONG = (
    "In the beginning of the nineteenth century, the city grew quickly along the river, and merchants "
    "from many countries came to trade wool, grain, timber and iron. "
)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def pipe(smollm2_source, dtype):
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path), token_budget=128, kv_cache_memory="256MiB", dtype=dtype, progress=False
    )
    assert p.runner.dtype == getattr(torch, dtype)
    yield p
    p.close()


@pytest.fixture(scope="module")
def prompts(pipe):
    ids = [pipe.chat_prompt_ids([{"role": "user", "content": c}]) for c in CHATS]
    ids += [pipe.tokenizer(p)["input_ids"] for p in PLAIN]
    long_ids = pipe.tokenizer(LONG * 12)["input_ids"][:300]
    ids.append(long_ids)
    lens = [len(p) for p in ids]
    assert min(lens) <= 5 and max(lens) == 300, lens
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_source, prompts, dtype):
    """transformers' greedy tokens and per-step logits for each prompt, run alone."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.path, dtype=getattr(torch, dtype)).eval()
    return [(*hf_greedy(hf, ids, NEW_TOKENS), dtype) for ids in prompts]


def test_alone_matches_transformers(pipe, prompts, reference):
    for i, ids in enumerate(prompts):
        r = pipe(ids, max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
        assert_matches(r.token_ids, *reference[i], what=f"prompt {i} alone")


@pytest.mark.parametrize("budget", [16, 64, 128, 256])
def test_together_matches_transformers(pipe, prompts, reference, budget):
    pipe.scheduler.slots["local"].token_budget = budget
    try:
        outs = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0)
    finally:
        pipe.scheduler.slots["local"].token_budget = pipe.token_budget
    for i, r in enumerate(outs):
        assert_matches(r.token_ids, *reference[i], what=f"prompt {i} of 8, budget {budget}")
    wait_all_free(pipe)  # blocks are freed with the worker's next plan, right after the last token


def test_capital_of_france(pipe):
    r = pipe.chat(
        [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32, temperature=0
    )
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == "stop"
