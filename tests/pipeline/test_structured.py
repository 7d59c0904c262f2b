"""Structured output and tool-call pieces without a model: parameters, proto, grammar cache, the
grammar mask and ``logit_bias`` in the vectorised sampler, matcher rebuild, and the tool-call parser.

Uses SmolLM2's tokenizer (49152 tokens) for the grammars; the logits are random.
"""

from __future__ import annotations

import json

import pytest
import torch

from fuseserve.errors import InvalidRequestError
from fuseserve.proto.convert import sampling_params_from_proto, sampling_params_to_proto
from fuseserve.sampling_params import SamplingParams
from fuseserve.structured import grammar_backend
from fuseserve.tools import ToolCallParser, check_tool_messages, check_tools, forced_call_schema
from fuseserve.worker.sampler import Sampler, SeqSamplingState

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_source):
    return smollm2_source.load_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    return grammar_backend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def sampler(backend, tokenizer):
    return Sampler([tokenizer.eos_token_id], len(tokenizer), lambda: backend)


# ------------------------------------------------------------------------------ params and proto
def test_params_roundtrip_proto_and_json():
    p = SamplingParams.from_kwargs(json_schema=SCHEMA, logit_bias={"7": -100, 9: 2.5})
    assert p.json_schema == json.dumps(SCHEMA) and p.logit_bias == {7: -100, 9: 2.5}
    assert sampling_params_from_proto(sampling_params_to_proto(p)) == p
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    q = SamplingParams.from_kwargs(choice=["yes", "no"])
    assert sampling_params_from_proto(sampling_params_to_proto(q)) == q
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())) == SamplingParams()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(regex="a", choice=["b"]), "choice"),
        (dict(json_schema="not json"), "json_schema"),
        (dict(json_schema="[1]"), "json_schema"),
        (dict(choice=[]), "choice"),
        (dict(regex=""), "regex"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={1: 101}), "logit_bias"),
    ],
)
def test_bad_constraints_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_kwargs(**kwargs)
    assert e.value.param == param


# ------------------------------------------------------------------------------ compile and cache
def test_compiled_once_and_bad_specs_say_why(backend):
    p = SamplingParams.from_kwargs(json_schema=SCHEMA)
    assert backend.compile("json_schema", p.json_schema) is backend.compile("json_schema", p.json_schema)
    for kwargs, why in [
        (dict(regex="a(b"), "parenthesis"),
        (dict(json_schema={"type": "nonsense"}), "nonsense"),
        (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
        (dict(regex=r"[^\s\S]"), "matches no string"),  # compiles, but no token may start it
    ]:
        with pytest.raises(InvalidRequestError, match=why) as e:
            backend.check(SamplingParams.from_kwargs(**kwargs))
        assert e.value.param in kwargs


def test_without_the_grammar_library_a_constrained_request_is_a_400(tokenizer, monkeypatch):
    """The gateway image has no torch, so no xgrammar: refused with a message, not a 500 or a crash."""
    import sys

    from fuseserve.structured import GrammarBackend

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(InvalidRequestError, match="grammar library") as e:
        GrammarBackend(tokenizer, len(tokenizer)).check(SamplingParams.from_kwargs(json_schema=SCHEMA))
    assert e.value.http_status == 400 and e.value.param == "response_format"


# ------------------------------------------------------------------------------ sampler
def _run(sampler, states, logits):
    out = sampler(logits, states).token_ids.tolist()
    for st, t in zip(states, out, strict=True):
        st.output_token_ids.append(t)
    return out


def test_mask_only_on_constrained_rows_and_logit_bias(sampler, tokenizer):
    torch.manual_seed(0)
    v = len(tokenizer)
    free = SeqSamplingState.create(SamplingParams(temperature=0.0), [])
    choice = SeqSamplingState.create(SamplingParams(temperature=0.0, choice=["yes", "no"]), [])
    biased = SeqSamplingState.create(SamplingParams(temperature=0.0, logit_bias={123: 100.0}), [])
    sampled = SeqSamplingState.create(SamplingParams(temperature=1.0, seed=3, regex="[0-9]{3}"), [])
    states = [free, choice, biased, sampled]
    for _ in range(8):
        logits = torch.randn(len(states), v)
        out = _run(sampler, states, logits)
        assert out[0] == int(logits[0].argmax())  # unconstrained row untouched
        assert out[2] == 123
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([t for t in choice.output_token_ids if t != eos]) in ("yes", "no")
    assert eos in choice.output_token_ids
    digits = tokenizer.decode([t for t in sampled.output_token_ids if t != eos])
    assert len(digits) == 3 and digits.isdigit()


def test_matcher_rebuilt_from_tokens_and_surplus_after_stop(sampler, tokenizer):
    """A recompute builds a fresh state whose output tokens come from the plan: the rebuilt matcher
    masks like the original. Tokens past the end (a stop learned one pass late) are only EOS."""
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.0, json_schema=json.dumps(SCHEMA))
    st = SeqSamplingState.create(params, [])
    logits = torch.randn(12, 1, len(tokenizer))
    for i in range(4):
        _run(sampler, [st], logits[i])
    again = SeqSamplingState.create(params, [], device="cpu")
    again.output_token_ids = list(st.output_token_ids)  # what the recompute plan carries
    for i in range(4, 12):
        assert _run(sampler, [again], logits[i].clone()) == _run(sampler, [st], logits[i].clone())
    text = tokenizer.decode([t for t in st.output_token_ids if t != tokenizer.eos_token_id])
    assert json.loads(text)["ok"] in (True, False)
    assert st.output_token_ids[-1] == tokenizer.eos_token_id


# ------------------------------------------------------------------------------ tools
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _stream(parser, text, step):
    content, calls = "", {}
    for i in range(0, len(text), step):
        d = parser.feed(text[i : i + step])
        content += d.content
        for c in d.tool_calls:
            calls.setdefault(c.index, {"name": c.name, "arguments": ""})["arguments"] += c.arguments
    d = parser.finish()
    content += d.content
    for c in d.tool_calls:
        calls.setdefault(c.index, {"name": c.name, "arguments": ""})["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_parser_auto_streamed_equals_whole(step):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = "Let me check. <tool_c" + call[len("<tool_c") :] + call + " done <tool"
    content, calls = _stream(ToolCallParser("auto"), text, step)
    assert content == "Let me check.  done <tool"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}] * 2


def test_parser_text_parser_protocol():
    """``push(text, delta)`` / ``finish(delta)``: the shared front end's hook gives the same result."""

    class Delta:
        def __init__(self):
            self.text, self.tool_calls = "", []

    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> bye'
    parser, delta = ToolCallParser("auto"), Delta()
    for i in range(0, len(text), 4):
        parser.push(text[i : i + 4], delta)
    parser.finish(delta)
    assert delta.text == "Hi  bye"
    assert [(c.name, c.arguments) for c in delta.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_parser_forced_modes():
    p = ToolCallParser("named", "get_weather")
    assert _stream(p, '{"city": "Oslo"}', 2) == (
        "",
        [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}],
    )
    assert p.calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    p = ToolCallParser("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert _stream(p, text, 5) == ("", [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert _stream(ToolCallParser("required"), '[{"name": "get_w', 5)[0] == '[{"name": "get_w'  # cut off


def test_tool_choice_and_messages_checked():
    assert check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == "get_weather"
    with pytest.raises(InvalidRequestError, match="not in tools"):
        check_tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError, match="required"):
        check_tools([], "required")
    schema = forced_call_schema([WEATHER], "required", parallel_tool_calls=False)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == [
        "get_weather"
    ]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    check_tool_messages(
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "5C", "tool_call_id": "c1"},
        ]
    )
    for bad in (
        [{"role": "tool", "content": "5C", "tool_call_id": "c1"}],
        [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "5C"}],
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}],
            }
        ],
        [{"role": "user", "content": "", "tool_calls": [call]}],
    ):
        with pytest.raises(InvalidRequestError):
            check_tool_messages(bad)


def test_padded_logits_columns_are_banned_in_constrained_rows(sampler, tokenizer):
    """A logits width above the vocabulary (padded lm_head): the extra columns never win."""
    v = len(tokenizer)
    st = SeqSamplingState.create(SamplingParams(temperature=0.0, choice=["yes", "no"]), [])
    free = SeqSamplingState.create(SamplingParams(temperature=0.0), [])
    logits = torch.randn(2, v + 64)
    logits[:, v:] = 1e4
    out = _run(sampler, [st, free], logits)
    assert out[0] < v and out[1] >= v
