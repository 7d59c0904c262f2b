"""The in-process pipeline end to end on the real SmolLM2-135M-Instruct (CPU).

Sampling reproducibility (a seeded request alone, beside 15 others, and preempted), greedy
equivalents, streaming detokenization and stop strings (stream == non-stream), typed errors that
never hang, concurrent callers, generation knobs (min_new_tokens, stop_token_ids, ignore_eos,
logprobs) and the finish reasons stop / length / abort with blocks freed after an abort.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from fuseserve.errors import (
    ContextLengthExceededError,
    FuseServeError,
    InvalidParameterError,
    InvalidRequestError,
)

TIMEOUT = 120  # seconds; a request that takes longer counts as hung
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=16)
BYTES_PER_BLOCK = 30 * 16 * 3 * 64 * 2 * 4  # layers x block tokens x kv heads x head dim x (K, V) x fp32
TINY_BLOCKS = 10


@pytest.fixture(scope="module")
def pipe(smollm2_source):
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path), token_budget=64, kv_cache_memory="256MiB", progress=False
    )
    yield p
    p.close()


@pytest.fixture(scope="module")
def tiny(smollm2_source):
    """The same model with a KV pool of 10 blocks (160 tokens): a handful of requests overflow it."""
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path),
        token_budget=64,
        kv_cache_memory=TINY_BLOCKS * BYTES_PER_BLOCK,
        progress=False,
    )
    assert p.runner.info.num_blocks == TINY_BLOCKS
    yield p
    p.close()


def chat(pipe, text: str) -> list[int]:
    return pipe.chat_prompt_ids([{"role": "user", "content": text}])


def in_thread(fn, timeout: float = TIMEOUT):
    """Run ``fn()`` in a thread; return its result or re-raise its exception; fail if it hangs."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_concurrently(fns, timeout: float = TIMEOUT) -> list:
    """Start every ``fn`` at the same moment in its own thread; results in order."""
    barrier = threading.Barrier(len(fns))
    results: list = [None] * len(fns)
    errors: list = []

    def target(i, fn):
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "concurrent calls hung"
    assert not errors, errors
    return results


def wait_all_free(p, timeout: float = 10.0) -> None:
    """Every KV block is free again, in the worker and in the scheduler's accounting."""
    account = p.scheduler.slots["local"].account
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.runner.num_free_blocks == p.runner.info.num_blocks and account.num_free == account.num_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"blocks not freed: worker {p.runner.num_free_blocks}/{p.runner.info.num_blocks}, "
        f"scheduler {account.num_free}/{account.num_blocks}"
    )


# ------------------------------------------------------------------------------------- sampling


def test_seeded_request_same_alone_and_beside_15_unseeded(pipe):
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


def test_preempted_requests_give_the_same_output(pipe, tiny):
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


# ------------------------------------------------------------------------------------- errors


def test_unknown_keyword_raises(pipe):
    with pytest.raises(InvalidRequestError) as e:
        pipe("Hello", max_new_tokens=4, temprature=0.5)
    assert e.value.param == "temprature" and "temprature" in str(e.value)
    with pytest.raises(InvalidRequestError):
        pipe.stream("Hello", bogus=1)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(pipe, kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        in_thread(lambda: pipe("Hello", **kwargs), timeout=30)
    assert e.value.param == param and param in str(e.value)


def test_context_length_exceeded(pipe):
    prompt = [42] * 8000
    with pytest.raises(ContextLengthExceededError) as e:
        pipe(prompt, max_new_tokens=500)
    err = e.value
    assert (err.prompt_tokens, err.max_new_tokens, err.max_model_len) == (8000, 500, 8192)
    for number in ("8000", "500", "8192", "8500"):
        assert number in str(err)
    with pytest.raises(ContextLengthExceededError):
        pipe.stream(prompt, max_new_tokens=500)
    # a prompt alone longer than the window
    with pytest.raises(ContextLengthExceededError) as e:
        pipe([42] * 9000, max_new_tokens=1)
    assert e.value.param == "prompt"


def test_request_larger_than_the_kv_pool_raises_not_hangs(tiny):
    with pytest.raises(InvalidRequestError) as e:
        in_thread(lambda: tiny([42] * 150, max_new_tokens=100), timeout=30)
    assert e.value.param == "max_tokens"


def test_empty_prompt_generates_from_bos_or_raises(pipe):
    for prompt in ("", []):
        try:
            out = in_thread(
                lambda p=prompt: list(pipe.stream(p, temperature=0.0, max_new_tokens=4)), timeout=60
            )
        except InvalidRequestError as e:
            assert e.param == "prompt"
            continue
        assert isinstance(out, list)
    r = in_thread(lambda: pipe("", temperature=0.0, max_new_tokens=4), timeout=60)
    assert len(r) == 1 and r[0].prompt_tokens == 1 and r[0].generated_tokens >= 1


def test_bad_prompt_types_raise(pipe):
    with pytest.raises(InvalidRequestError):
        pipe([10**9], max_new_tokens=2)  # token id outside the vocabulary
    with pytest.raises(InvalidRequestError):
        pipe([["nested"]], max_new_tokens=2)


# ------------------------------------------------------------------------------------- concurrency


def test_concurrent_callers_get_solo_greedy_results(pipe):
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


def test_abort_by_leaving_a_stream_frees_blocks(pipe):
    ids = chat(pipe, "Write a long story about a dragon.")
    stream = pipe.stream(ids, temperature=0.0, max_new_tokens=200, ignore_eos=True)
    pieces = [next(stream) for _ in range(3)]
    assert all(isinstance(p, str) for p in pieces)
    assert pipe.runner.num_free_blocks < pipe.runner.info.num_blocks  # the request holds blocks now
    stream.close()  # the consumer goes away
    wait_all_free(pipe)
    assert pipe.scheduler.num_running == 0 and not pipe.scheduler.waiting
    # the pipeline still serves
    assert pipe("Hello", temperature=0.0, max_new_tokens=2)[0].generated_tokens == 2


def test_close_aborts_pending_requests(tiny):
    """Runs last on the tiny pipeline: closing it ends a running request with finish_reason abort."""
    ids = chat(tiny, "Write a long story about a dragon.")
    box = {}
    t = threading.Thread(
        target=lambda: box.update(r=tiny(ids, temperature=0.0, max_new_tokens=80, ignore_eos=True))
    )
    t.start()
    deadline = time.monotonic() + 30
    while tiny.scheduler.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    tiny.close()
    t.join(30)
    assert not t.is_alive()
    (r,) = box["r"]
    assert r.finish_reason == "abort" and r.generated_tokens < 80


def test_stream_tokens_yields_every_token_and_the_same_text(pipe):
    full = pipe("Name three colors.", max_new_tokens=12, temperature=0.0, ignore_eos=True)[0]
    pairs = list(
        pipe.stream_tokens("Name three colors.", max_new_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert [t for t, _ in pairs] == full.token_ids
    assert "".join(d for _, d in pairs) == full.text


@pytest.mark.parametrize("bad", [None, 5, {"a": 1}, [[1, [2]]], ["ok", 3], "a\ud800b"])
def test_malformed_prompts_raise_typed_errors(pipe, bad):
    with pytest.raises(InvalidRequestError):
        pipe(bad, max_new_tokens=2)


def test_lone_surrogate_in_chat_raises(pipe):
    with pytest.raises(InvalidRequestError) as e:
        pipe.chat([{"role": "user", "content": "a\udfffb"}], max_new_tokens=2)
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"stop_token_ids": [2**63]},
        {"stop": ["\ud800"]},
        {"repetition_penalty": 1e-300},
    ],
)
def test_values_that_cannot_cross_the_wire_are_rejected_and_the_pipeline_lives(pipe, kw):
    with pytest.raises(InvalidParameterError):
        pipe("Hi", max_new_tokens=2, **kw)
    assert pipe("Hi", max_new_tokens=2, temperature=0)[0].generated_tokens >= 1


def test_tiny_temperature_is_greedy(pipe):
    tiny = pipe("The sky is", max_new_tokens=4, temperature=1e-300)[0]
    greedy = pipe("The sky is", max_new_tokens=4, temperature=0)[0]
    assert tiny.token_ids == greedy.token_ids


def test_a_failed_step_fails_only_its_requests(pipe):
    """An engine error inside a step surfaces as a FuseServeError to that request; the pipeline lives."""
    real_step = pipe.runner.step
    calls = {"n": 0}

    def broken_once(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step(plan)

    pipe.loop.workers["local"] = type("BrokenOnce", (), {"step": staticmethod(broken_once)})()
    try:
        with pytest.raises(FuseServeError, match="injected failure"):
            pipe("Hello there", max_new_tokens=4, temperature=0)
    finally:
        pipe.loop.workers["local"] = pipe.runner
    assert pipe("Hello there", max_new_tokens=4, temperature=0)[0].generated_tokens == 4
    assert pipe.runner.num_free_blocks == pipe.runner.info.num_blocks
