"""SmolLM2-135M-Instruct (the real model): greedy tokens equal ``transformers.generate``.

Prompts run alone and all eight together, with token budgets 16, 64, 128 and 256 (so prompts are
split into chunks of those sizes and packed beside each other's decode tokens). Both dtypes run:
fuseserve in fp32 against ``transformers`` in fp32, and fuseserve in bf16 against ``transformers`` in
bf16, each with its rule (``greedy_check``): in fp32 a divergence is accepted only at a near-tie
(transformers' two candidate logits less than 1e-3 apart); in bf16, where how each side rounds depends
on the CPU, wherever each side's token is among the other's top 5 at that step.

The strong bf16 check: on the eight prompts, each followed by transformers' fp32 greedy continuation,
fuseserve's bf16 logits at those 32 steps are no farther from transformers' fp32 logits than
transformers' bf16 logits are (``assert_no_farther_from_fp32``; ``pytest -s`` prints both errors).
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import chunked_logits
from greedy_check import TOP_K, assert_matches, assert_no_farther_from_fp32, hf_greedy
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
def prompts(smollm2_source):
    """The eight prompts' token ids (the same for both dtypes): chats through the chat template as the
    pipeline renders them, plain text, and a 300-token text."""
    from fuseserve.frontend.model_info import build_encoder, load_tokenizer

    tokenizer = load_tokenizer(smollm2_source)
    encoder = build_encoder(smollm2_source, tokenizer)
    ids = [encoder.chat([{"role": "user", "content": c}]) for c in CHATS]
    ids += [tokenizer(p)["input_ids"] for p in PLAIN]
    ids.append(tokenizer(LONG * 12)["input_ids"][:300])
    lens = [len(p) for p in ids]
    assert min(lens) <= 5 and max(lens) == 300, lens
    return ids


def _hf(smollm2_source, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.path, dtype=dtype).eval()
    assert {p.dtype for p in hf.parameters()} == {dtype}
    return hf


@pytest.fixture(scope="module")
def reference_fp32(smollm2_source, prompts):
    """transformers' fp32 greedy tokens and per-step logits for each prompt, run alone (the fp32
    reference of both the fp32 greedy test and the bf16 logit check)."""
    hf = _hf(smollm2_source, torch.float32)
    return [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def hf_bf16(smollm2_source):
    return _hf(smollm2_source, torch.bfloat16)


@pytest.fixture(scope="module")
def reference(request, dtype, prompts):
    """transformers' greedy tokens and per-step logits for each prompt in ``dtype``, run alone."""
    if dtype == "float32":
        return request.getfixturevalue("reference_fp32")
    hf = request.getfixturevalue("hf_bf16")
    return [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]


def _top_ids(r) -> list[list[int]]:
    """fuseserve's top-``TOP_K`` token ids per generated token of response ``r``."""
    return [[t.token_id for t in step] for step in r.top_logprobs]


def test_alone_matches_transformers(pipe, prompts, reference, dtype):
    for i, ids in enumerate(prompts):
        r = pipe(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP_K)[0]
        assert_matches(r.token_ids, *reference[i], dtype, our_top=_top_ids(r), what=f"prompt {i} alone")


@pytest.mark.parametrize("budget", [16, 64, 128, 256])
def test_together_matches_transformers(pipe, prompts, reference, dtype, budget):
    pipe.scheduler.slots["local"].token_budget = budget
    try:
        outs = pipe(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP_K)
    finally:
        pipe.scheduler.slots["local"].token_budget = pipe.token_budget
    for i, r in enumerate(outs):
        what = f"prompt {i} of 8, budget {budget}"
        assert_matches(r.token_ids, *reference[i], dtype, our_top=_top_ids(r), what=what)
    wait_all_free(pipe)  # blocks are freed with the worker's next plan, right after the last token


def test_capital_of_france(pipe):
    r = pipe.chat(
        [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32, temperature=0
    )
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == "stop"


def test_bf16_logits_no_farther_from_fp32_than_transformers(smollm2_source, prompts, reference_fp32, hf_bf16):
    """Each prompt followed by transformers' fp32 greedy continuation, all eight in one fuseserve bf16
    pass (a runner of its own) and one transformers bf16 forward each; the fp32 reference is
    transformers' fp32 logits at each greedy step (``reference_fp32``)."""
    from fuseserve.config import EngineConfig
    from fuseserve.worker.model_runner import ModelRunner

    runner = ModelRunner(
        smollm2_source.path,
        smollm2_source.config,
        smollm2_source.eos_token_ids(),
        EngineConfig(kv_cache_memory="64MiB", device="cpu", dtype="bfloat16"),
        progress=False,
    )
    assert runner.dtype == torch.bfloat16
    seqs = {i: ids + tokens for i, (ids, (tokens, _)) in enumerate(zip(prompts, reference_fp32, strict=True))}
    ours_all = chunked_logits(runner, seqs, dict.fromkeys(seqs, max(map(len, seqs.values()))))
    ours, theirs, fp32 = [], [], []
    for i, (ids, (tokens, logits)) in enumerate(zip(prompts, reference_fp32, strict=True)):
        steps = slice(len(ids) - 1, len(ids) - 1 + len(tokens))  # the positions that predict ``tokens``
        ours.append(ours_all[i][steps])
        with torch.no_grad():  # the last len(tokens) + 1 positions' logits; the very last predicts nothing
            out = hf_bf16(torch.tensor([seqs[i]]), logits_to_keep=len(tokens) + 1).logits[0, :-1]
        theirs.append(out.float())
        fp32.append(torch.stack(logits))
    assert_no_farther_from_fp32(torch.cat(ours), torch.cat(theirs), torch.cat(fp32), what="SmolLM2-135M")
