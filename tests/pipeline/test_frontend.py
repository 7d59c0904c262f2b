"""The shared front end (``fuseserve/frontend/``) without an engine: the SamplingParams table and its
surfaces (OpenAI body, CLI, proto), prompt encoding, and the output state's deltas."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from sampling_cases import full_params

from fuseserve.errors import ContextLengthExceededError, InvalidParameterError, InvalidRequestError
from fuseserve.frontend import Delta, OutputState, PromptEncoder, as_batch
from fuseserve.frontend.params import (
    add_cli_flags,
    body_from_params,
    cli_kwargs,
    openai_model_fields,
    params_kwargs_from_body,
)
from fuseserve.proto.convert import sampling_params_from_proto, sampling_params_to_proto
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import FinishReason, SampledToken, TokenEvent, TokenLogprob

FULL = full_params()  # every field set
BY_HAND = {"logprobs", "prompt_logprobs"}  # per-endpoint OpenAI shapes (openai_params.py); not CLI flags
BY_HAND |= {"json_schema", "regex", "choice", "grammar", "logit_bias"}  # frontend/constraints.py's


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def test_every_field_reaches_every_surface():
    """Each SamplingParams field is in the OpenAI body (or mapped by hand), the CLI, and the proto."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    body = body_from_params(FULL)
    assert params_kwargs_from_body(body) == {
        k: v for k, v in dataclasses.asdict(FULL).items() if k not in BY_HAND
    }
    assert set(openai_model_fields()) == set(body)
    assert body["max_tokens"] == FULL.max_new_tokens and body["min_tokens"] == FULL.min_new_tokens
    assert sampling_params_from_proto(sampling_params_to_proto(FULL)) == FULL
    none = SamplingParams()
    assert sampling_params_from_proto(sampling_params_to_proto(none)) == none
    parser = argparse.ArgumentParser()
    add_cli_flags(parser, {"temperature": 0.0})
    flags = {a.dest for a in parser._actions} - {"help"}
    assert flags == names - BY_HAND
    args = parser.parse_args(["--stop", "x", "--stop", "y", "--seed", "3", "--ignore-eos", "--top-k", "4"])
    assert cli_kwargs(args) == {
        "temperature": 0.0,
        "seed": 3,
        "stop": ["x", "y"],
        "ignore_eos": True,
        "top_k": 4,
    }
    assert SamplingParams.from_kwargs(**cli_kwargs(args)).top_k == 4


def test_as_batch_shapes():
    assert as_batch("a") == ["a"]
    assert as_batch([1, 2]) == [[1, 2]]
    assert as_batch(["a", [3]]) == ["a", [3]]
    for bad in (None, 5, {"a": 1}, [[1, "x"]], [True]):
        with pytest.raises(InvalidRequestError):
            as_batch(bad)
    with pytest.raises(InvalidRequestError, match="empty"):
        as_batch([])


def test_encoder_text_ids_chat_and_context(tok):
    enc = PromptEncoder(tok, len(tok), max_model_len=32)
    assert enc.encode("Hello there") == tok("Hello there")["input_ids"]
    assert enc.encode([1, 2, 3]) == [1, 2, 3]
    for empty in ("", []):
        with pytest.raises(InvalidRequestError, match="empty"):
            enc.encode(empty)
    with pytest.raises(InvalidRequestError, match="outside"):
        enc.encode([len(tok)])
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}]}
    ]
    messages.append({"role": "user", "content": "Hi"})
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert enc.chat(messages) == tok(expected, add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidRequestError):
        enc.chat([{"content": "no role"}])
    assert enc.max_new_tokens(10, None) == 22  # the rest of the context, as vLLM
    assert enc.max_new_tokens(10, 22) == 22
    with pytest.raises(ContextLengthExceededError):
        enc.max_new_tokens(10, 23)
    with pytest.raises(InvalidParameterError):
        enc.max_new_tokens(10, 0)


def test_encoder_without_tokenizer_takes_token_ids_only():
    enc = PromptEncoder(None, 100, 64)
    assert enc.encode([5, 6]) == [5, 6]
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        enc.encode("text")
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        enc.chat([{"role": "user", "content": "x"}])


def _event(token_id, logprob=None, top=(), **kw) -> TokenEvent:
    token = None if token_id is None else SampledToken(1, token_id, logprob, list(top))
    return TokenEvent(1, token, **kw)


def test_output_state_stop_string_hidden_eos_duplicates_and_logprobs(tok):
    ids = tok(" one two three four")["input_ids"]
    state = OutputState([1], SamplingParams(stop=["three"], logprobs=1), tok)
    text = ""
    for i, t in enumerate(ids):
        d = Delta()
        assert state.apply(_event(t, -0.5, [TokenLogprob(t, -0.5)], index=i), d)
        assert not state.apply(_event(t, -0.5, index=i), Delta())  # a resent event is dropped
        text += d.text
        if d.finished:
            break
    assert state.finish_reason == "stop" and state.stop_matched
    assert text == state.text == " one two "
    assert [e.token_id for e in state.visible] == state.token_ids and state.logprobs == [-0.5] * len(
        state.token_ids
    )
    state = OutputState([1], SamplingParams(), tok)
    d = Delta()
    state.apply(_event(ids[0]), d)
    state.apply(_event(2, hidden=True, finish_reason=FinishReason.STOP), d)
    assert d.finished and d.text == state.text == tok.decode(ids[:1]) and state.token_ids == [ids[0], 2]


def test_output_state_text_parser_hook(tok):
    """A parser between the detokenized text and the delta sees all text and decides what is shown."""

    class Upper:
        def push(self, text, delta):
            delta.text += text.upper()

        def finish(self, delta):
            delta.tool_calls.append("done")

    ids = tok(" hello world")["input_ids"]
    state = OutputState([1], SamplingParams(), tok, text_parser=Upper())
    d = Delta()
    for t in ids:
        state.apply(_event(t), d)
    state.apply(_event(None, finish_reason=FinishReason.LENGTH), d)
    assert state.text == d.text == " HELLO WORLD" and d.tool_calls == ["done"]
