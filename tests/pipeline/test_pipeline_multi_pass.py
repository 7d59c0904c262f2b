"""Multi-step decoding on the real SmolLM2-135M-Instruct (fp32, CPU): ``pipeline(decode_passes=4)``
gives the tokens, text, finish reasons and usage counts of the one-pass pipeline, streamed or not,
with greedy, seeded sampling, penalties and logprobs, and every KV block back at the end. The
scheduler side with many sequences, preemption and a lost worker: ``test_multi_pass.py``."""

from __future__ import annotations

import pytest
from pipeline_harness import chat, run_concurrently, wait_all_free


@pytest.fixture(scope="module")
def multi(smollm2_source):
    """The ``pipe`` pipeline (overlap on) with ``decode_passes=4``; ``passes`` records each plan's."""
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path),
        token_budget=64,
        kv_cache_memory="256MiB",
        dtype="float32",
        progress=False,
        decode_passes=4,
    )
    p.passes = []
    step = p.runner.step

    def recording(plan):
        p.passes.append(plan.num_passes)
        return step(plan)

    p.runner.step = recording
    yield p
    p.close()


KNOBS = [
    dict(temperature=0.0, max_new_tokens=40),  # ends on EOS
    dict(temperature=0.0, max_new_tokens=7),  # ends on max_tokens, not a multiple of 4
    dict(temperature=0.0, max_new_tokens=40, stop=[" is", "."]),  # a stop string
    dict(temperature=0.0, max_new_tokens=40, stop_token_ids=[30]),  # "." (maybe) as a stop id
    dict(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=16, repetition_penalty=1.3),  # seeded
    dict(temperature=0.0, max_new_tokens=9, logprobs=2, min_new_tokens=3),
]


@pytest.mark.parametrize("kw", KNOBS, ids=["eos", "length", "stop_str", "stop_id", "seeded", "logprobs"])
def test_four_passes_give_what_one_gives(pipe, multi, kw):
    questions = ["What is the capital of France?", "Say hi.", "Name a colour.", "What is 2 + 2?"]
    prompts = [chat(pipe, q) for q in questions]
    ref = [pipe(p, **kw)[0] for p in prompts]
    alone = [multi(p, **kw)[0] for p in prompts]
    before = len(multi.passes)
    got = run_concurrently([lambda p=p: multi(p, **kw)[0] for p in prompts])
    streamed = run_concurrently([lambda p=p: "".join(multi.stream(p, **kw)) for p in prompts])
    assert max(multi.passes[before:]) > 1  # multi-step plans ran beside others
    for r, a, g, st in zip(ref, alone, got, streamed, strict=True):
        for x in (a, g):
            assert x.token_ids == r.token_ids, kw
            assert x.text == r.text == st, kw
            assert x.finish_reason == r.finish_reason, kw
            assert x.generated_tokens == r.generated_tokens == len(x.token_ids), kw
            assert x.prompt_tokens == r.prompt_tokens
            if kw.get("logprobs") is not None:
                assert x.logprobs == pytest.approx(r.logprobs, abs=1e-4)
                assert [[t.token_id for t in a] for a in x.top_logprobs] == [
                    [t.token_id for t in a] for a in r.top_logprobs
                ]
        if r.finish_reason == "length":
            assert r.generated_tokens == kw["max_new_tokens"]
    wait_all_free(multi)
