"""The in-process pipeline's failure paths on the real SmolLM2-135M-Instruct (CPU).

Typed errors that never hang (unknown keywords, invalid values naming the parameter, context
length, a request larger than the KV pool, empty / malformed prompts, lone surrogates, values that
cannot cross the wire), abort by leaving a stream with blocks freed, close ending pending requests
with finish_reason abort, and a failed step failing only its own requests.
"""

from __future__ import annotations

import threading

import pytest
from pipeline_harness import chat, in_thread, wait_all_free
from stack_harness import wait_for

from fuseserve.errors import (
    ContextLengthExceededError,
    FuseServeError,
    InvalidParameterError,
    InvalidRequestError,
)

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


def test_empty_prompt_raises_as_in_the_gateway(pipe):
    """As vLLM ("the decoder prompt cannot be empty"), and as the gateway's 400."""
    for prompt in ("", [], [""]):
        with pytest.raises(InvalidRequestError, match="empty") as e:
            pipe(prompt, max_new_tokens=4)
        assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        next(iter(pipe.stream("", max_new_tokens=4)))


def test_bad_prompt_types_raise(pipe):
    with pytest.raises(InvalidRequestError):
        pipe([10**9], max_new_tokens=2)  # token id outside the vocabulary
    with pytest.raises(InvalidRequestError):
        pipe([["nested"]], max_new_tokens=2)


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
    wait_for(lambda: tiny.scheduler.num_running, 30, "the request running")
    tiny.close()
    t.join(30)
    assert not t.is_alive()
    (r,) = box["r"]
    assert r.finish_reason == "abort" and r.generated_tokens < 80


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


def test_a_failed_step_fails_only_its_requests(pipe, monkeypatch):
    """An engine error inside a step surfaces as a FuseServeError to that request; the pipeline lives."""
    real_step = pipe.runner.step
    calls = {"n": 0}

    def broken_once(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step(plan)

    wait_all_free(pipe)  # no plan carrying an earlier test's frees is still to come
    monkeypatch.setattr(pipe.runner, "step", broken_once)
    try:
        with pytest.raises(FuseServeError, match="injected failure"):
            pipe("Hello there", max_new_tokens=4, temperature=0)
    finally:
        monkeypatch.undo()
    assert pipe("Hello there", max_new_tokens=4, temperature=0)[0].generated_tokens == 4
    wait_all_free(pipe)  # blocks are freed with the worker's next plan, right after the last token
