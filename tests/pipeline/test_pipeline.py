"""The in-process pipeline end to end on the real SmolLM2-135M-Instruct (CPU).

Sampling reproducibility (a seeded request alone, beside 15 others, and preempted), greedy
equivalents, streaming detokenization and stop strings (stream == non-stream), concurrent callers,
generation knobs (min_new_tokens, stop_token_ids, ignore_eos, logprobs) and the finish reasons
stop / length. Typed errors, aborts and a failed step are in ``test_pipeline_errors.py``.
"""

from __future__ import annotations

import math

import pytest
from pipeline_harness import chat, in_thread, pipelines, run_concurrently, wait_all_free

SAMPLED = dict(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=16)


# ------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_seeded_request_same_alone_and_beside_15_unseeded(request, overlap):
    pipe = pipelines(request, overlap)[0]
    ids = chat(pipe, "Write a two-line poem about autumn leaves.")
    alone = in_thread(lambda: pipe(ids, **SAMPLED)[0])
    assert alone.generated_tokens > 5
    distinct = [chat(pipe, f"Tell me a fact about the number {n}.") for n in range(5)]
    others = [distinct[i % 5] for i in range(15)]  # each prompt three times
    unseeded = dict(temperature=0.8, top_p=0.9, max_new_tokens=12)
    calls = [lambda: pipe(ids, **SAMPLED)[0]] + [lambda o=o: pipe(o, **unseeded)[0] for o in others]
    results = run_concurrently(calls)
    assert results[0].text == alone.text
    assert results[0].token_ids == alone.token_ids
    # the unseeded neighbours really sample: the same prompt does not always give the same tokens
    same_prompt = [{tuple(r.token_ids) for r in results[1 + i :: 5]} for i in range(5)]
    assert any(len(outs) > 1 for outs in same_prompt)
    wait_all_free(pipe)


def test_greedy_equivalents(pipe):
    ids = chat(pipe, "Name three colours of the rainbow.")
    kw = dict(max_new_tokens=12, ignore_eos=True)
    t0, k1, p0 = run_concurrently(
        [
            lambda: pipe(ids, temperature=0.0, **kw)[0],
            lambda: pipe(ids, temperature=1.0, top_k=1, **kw)[0],
            lambda: pipe(ids, temperature=1.0, top_p=1e-9, **kw)[0],
        ]
    )
    assert t0.generated_tokens > 3
    assert t0.token_ids == k1.token_ids == p0.token_ids
    assert t0.text == k1.text == p0.text


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_preempted_requests_give_the_same_output(request, overlap):
    pipe, tiny = pipelines(request, overlap)
    seeded_ids = chat(pipe, "Write a two-line poem about autumn leaves.")
    prompts = [chat(pipe, q) for q in ("What is 2 + 2?", "Describe the sea.", "Who wrote Hamlet?", "Say hi.")]
    greedy = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    ref_seeded, *ref_greedy = run_concurrently(  # the roomy pipeline never preempts
        [lambda: pipe(seeded_ids, **SAMPLED)[0]] + [lambda p=p: pipe(p, **greedy)[0] for p in prompts]
    )
    assert pipe.scheduler.num_preemptions == 0
    before = tiny.scheduler.num_preemptions
    calls = [lambda: tiny(seeded_ids, **SAMPLED)[0]] + [lambda p=p: tiny(p, **greedy)[0] for p in prompts]
    results = run_concurrently(calls)
    assert tiny.scheduler.num_preemptions > before, "the tiny KV pool should have forced preemptions"
    assert results[0].token_ids == ref_seeded.token_ids
    assert results[0].text == ref_seeded.text
    for got, ref in zip(results[1:], ref_greedy, strict=True):
        assert got.token_ids == ref.token_ids
    wait_all_free(tiny)


# ------------------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize(
    "prompt",
    ["chat", "你好世界 🙂👍🏽 ñandú. 你好世界 🙂👍🏽 ñandú. 你好世界"],
    ids=["chat_template", "raw_continuation"],
)
def test_multibyte_text_stream_equals_non_stream(pipe, prompt):
    ids = chat(pipe, "Repeat exactly: 你好世界 🙂👍🏽 ñandú") if prompt == "chat" else prompt
    full = pipe(ids, temperature=0.0, max_new_tokens=12)[0]
    deltas = in_thread(lambda: list(pipe.stream(ids, temperature=0.0, max_new_tokens=12)))
    assert "".join(deltas) == full.text
    assert full.text.strip()
    assert not any("\ufffd" in d for d in deltas)
    assert full.text == pipe.tokenizer.decode(
        [t for t in full.token_ids if t not in pipe.eos_token_ids], skip_special_tokens=True
    )
    if prompt != "chat":  # the model continues with emoji, each split over several byte tokens
        assert "🙂" in full.text or "👍" in full.text, full.text
        assert len(full.token_ids) > len(deltas)  # some tokens produced no text until completed


def expected_stop(text: str, stops: list[str]) -> str:
    """The text before the stop string that completes first (ties: the one starting first)."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    assert found, (text, stops)
    return text[: min(found)[1]]


@pytest.mark.parametrize(
    "stops",
    [
        ["capi"],  # ends inside the token " capital"
        ["of France is"],  # spans several tokens
        ["France is", "ance"],  # overlapping: "ance" completes first
        ["is Paris", "s Par"],  # overlapping, the shorter one inside the longer
    ],
    ids=["inside_token", "several_tokens", "overlap", "nested"],
)
def test_stop_strings_stream_equals_non_stream(pipe, stops):
    ids = chat(pipe, "What is the capital of France?")
    free = pipe(ids, temperature=0.0, max_new_tokens=16)[0]
    assert "Paris" in free.text
    got = pipe(ids, temperature=0.0, max_new_tokens=16, stop=stops)[0]
    streamed = "".join(
        in_thread(lambda: list(pipe.stream(ids, temperature=0.0, max_new_tokens=16, stop=stops)))
    )
    assert got.finish_reason == "stop"
    assert got.text == expected_stop(free.text, stops)
    assert streamed == got.text
    assert got.generated_tokens < free.generated_tokens
    wait_all_free(pipe)  # the stop string aborted the sequence: its blocks are back


# ------------------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_concurrent_callers_get_solo_greedy_results(request, overlap):
    pipe = pipelines(request, overlap)[0]
    questions = [
        "What is the capital of France?",
        "List three prime numbers.",
        "Write a haiku about the sea.",
        "What colour is the sky?",
    ]
    prompts = [chat(pipe, q) for q in questions]
    kw = dict(temperature=0.0, max_new_tokens=12)
    solo = [pipe(p, **kw)[0] for p in prompts]
    calls = [lambda p=p: pipe(p, **kw)[0] for p in prompts]
    calls += [lambda p=p: "".join(pipe.stream(p, **kw)) for p in prompts[:3]]
    results = run_concurrently(calls)
    for got, ref in zip(results[: len(prompts)], solo, strict=True):
        assert got.token_ids == ref.token_ids
        assert got.text == ref.text
    for got, ref in zip(results[len(prompts) :], solo[:3], strict=True):
        assert got == ref.text
    # one call with a batch of prompts gives the same too
    batch = pipe(prompts, **kw)
    assert [r.token_ids for r in batch] == [r.token_ids for r in solo]
    wait_all_free(pipe)


# ------------------------------------------------------------------------------------- knobs


@pytest.fixture(scope="module")
def france(pipe):
    ids = chat(pipe, "What is the capital of France?")
    ref = pipe(ids, temperature=0.0, max_new_tokens=32)[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in pipe.eos_token_ids
    assert "Paris" in ref.text
    return ids, ref


def test_finish_reasons_stop_and_length(pipe, france):
    ids, ref = france
    assert ref.finish_reason == "stop"
    assert ref.generated_tokens == len(ref.token_ids)
    short = pipe(ids, temperature=0.0, max_new_tokens=3)[0]
    assert short.finish_reason == "length" and short.token_ids == ref.token_ids[:3]


def test_min_new_tokens_and_ignore_eos(pipe, france):
    ids, ref = france
    n_eos = len(ref.token_ids)  # EOS comes at this position
    r = pipe(ids, temperature=0.0, max_new_tokens=n_eos + 6, min_new_tokens=n_eos + 3)[0]
    assert r.token_ids[: n_eos - 1] == ref.token_ids[:-1]
    assert not any(t in pipe.eos_token_ids for t in r.token_ids[: n_eos + 2])
    assert r.generated_tokens >= n_eos + 3
    r = pipe(ids, temperature=0.0, max_new_tokens=n_eos + 6, ignore_eos=True)[0]
    assert r.finish_reason == "length" and r.generated_tokens == n_eos + 6
    assert not any(t in pipe.eos_token_ids for t in r.token_ids)
    assert r.token_ids[: n_eos - 1] == ref.token_ids[:-1]


def test_stop_token_ids(pipe, france):
    ids, ref = france
    stop_id = ref.token_ids[3]
    r = pipe(ids, temperature=0.0, max_new_tokens=32, stop_token_ids=[stop_id])[0]
    assert r.finish_reason == "stop"
    assert r.token_ids == ref.token_ids[:4]
    assert r.text == pipe.tokenizer.decode(ref.token_ids[:3], skip_special_tokens=True)
    # banned before min_new_tokens
    r = pipe(ids, temperature=0.0, max_new_tokens=32, stop_token_ids=[stop_id], min_new_tokens=5)[0]
    assert stop_id not in r.token_ids[:5]


def test_logprobs(pipe, france):
    ids, ref = france
    r = pipe(ids, temperature=0.0, max_new_tokens=32, logprobs=3)[0]
    assert r.token_ids == ref.token_ids
    assert len(r.logprobs) == len(r.token_ids) == len(r.top_logprobs)
    for tok, lp, tops in zip(r.token_ids, r.logprobs, r.top_logprobs, strict=True):
        assert lp <= 0.0 and math.isfinite(lp)
        assert len(tops) == 3
        assert tops[0].logprob >= lp - 1e-5
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token_id == tok and tops[0].logprob == pytest.approx(lp, abs=1e-5)  # greedy
        assert sum(math.exp(t.logprob) for t in tops) <= 1.0 + 1e-4
    r0 = pipe(ids, temperature=0.0, max_new_tokens=4, logprobs=0)[0]
    assert len(r0.logprobs) == 4 and all(t == [] for t in r0.top_logprobs)
    assert r0.logprobs == pytest.approx(r.logprobs[:4], abs=1e-4)
    sampled = pipe(
        ids, max_new_tokens=8, logprobs=2, **{k: v for k, v in SAMPLED.items() if k != "max_new_tokens"}
    )[0]
    for lp, tops in zip(sampled.logprobs, sampled.top_logprobs, strict=True):
        assert lp <= tops[0].logprob + 1e-5
    assert pipe(ids, temperature=0.0, max_new_tokens=4)[0].logprobs == []


def test_stream_tokens_yields_every_token_and_the_same_text(pipe):
    full = pipe("Name three colors.", max_new_tokens=12, temperature=0.0, ignore_eos=True)[0]
    pairs = list(
        pipe.stream_tokens("Name three colors.", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert [t for t, _ in pairs] == full.token_ids
    assert "".join(d for _, d in pairs) == full.text


def test_tiny_temperature_is_greedy(pipe):
    tiny = pipe("The sky is", max_new_tokens=4, temperature=1e-300)[0]
    greedy = pipe("The sky is", max_new_tokens=4, temperature=0)[0]
    assert tiny.token_ids == greedy.token_ids


# ------------------------------------------------------------------------------------- overlap


def test_stops_learned_a_pass_late_never_leak(pipe, pipe_serial):
    """With overlap a sequence that just sampled EOS (or a stop token id, or text matching a stop
    string) is decoded once more before the engine knows: that surplus token must not reach the
    text, the token ids, the usage counts or the stream. Every request gives exactly what it gives
    with overlap off, streamed or not, alone or beside others."""
    questions = ["What is the capital of France?", "Say hi.", "Name a colour.", "What is 2 + 2?"]
    prompts = [chat(pipe, q) for q in questions]
    knobs = [
        dict(temperature=0.0, max_new_tokens=40),  # ends on EOS
        dict(temperature=0.0, max_new_tokens=5),  # ends on max_tokens
        dict(temperature=0.0, max_new_tokens=40, stop=[" is", "."]),  # ends on a stop string
        dict(temperature=0.0, max_new_tokens=40, stop_token_ids=[30]),  # "." (maybe) as a stop id
    ]
    for kw in knobs:
        ref = [pipe_serial(p, **kw)[0] for p in prompts]
        got = run_concurrently([lambda p=p, kw=kw: pipe(p, **kw)[0] for p in prompts])
        streamed = run_concurrently([lambda p=p, kw=kw: "".join(pipe.stream(p, **kw)) for p in prompts])
        for r, g, st in zip(ref, got, streamed, strict=True):
            assert g.token_ids == r.token_ids, kw
            assert g.text == r.text == st, kw
            assert g.finish_reason == r.finish_reason, kw
            assert g.generated_tokens == r.generated_tokens == len(g.token_ids), kw
            assert g.prompt_tokens == r.prompt_tokens
            assert g.generated_tokens <= kw["max_new_tokens"]
            if r.finish_reason == "length":
                assert g.generated_tokens == kw["max_new_tokens"]
    wait_all_free(pipe)
    wait_all_free(pipe_serial)


def test_repeated_prompt_reuses_its_cached_prefix(pipe):
    """Prefix caching is on by default: a prompt sent again reuses the KV of its full blocks and says
    so in ``Response.cached_tokens``; the output is unchanged."""
    ids = chat(pipe, "Name three rivers of Europe and one fact about each of them, briefly. " * 3)
    first = pipe(ids, temperature=0.0, max_new_tokens=4)[0]
    again = pipe(ids, temperature=0.0, max_new_tokens=4)[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens == (len(ids) - 1) // 16 * 16 > 0


def test_latency_targets_keep_greedy_outputs(pipe, smollm2_source):
    """With targets each pass's budget is chosen per pass (prior: this device's start-up profile);
    the greedy tokens stay those of the fixed-budget pipeline."""
    import fuseserve

    prompts = [chat(pipe, q) for q in ("What is 2 + 2?", "Describe the sea in detail.", "Who wrote Hamlet?")]
    greedy = dict(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref = run_concurrently([lambda p=p: pipe(p, **greedy)[0] for p in prompts])
    slo = fuseserve.pipeline(
        str(smollm2_source.path),
        token_budget=16,
        kv_cache_memory="256MiB",
        dtype="float32",
        progress=False,
        target_itl=30.0,
        target_prefill_rate=1e9,  # every prompt is past its deadline at once: passes grow to the limit
    )
    budgets = []
    slo.scheduler.pass_observers.append(lambda _w, b, _n: budgets.append(b))
    try:
        assert slo.scheduler.slots["local"].latency.ready  # the profile is the prior
        got = run_concurrently([lambda p=p: slo(p, **greedy)[0] for p in prompts])
    finally:
        slo.close()
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert max(budgets) > 16  # grown past the fixed budget while prompts waited
