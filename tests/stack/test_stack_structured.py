"""Structured output and tool calls through the stack (``fuseserve serve``) with the ``openai`` client.

SmolLM2-135M on 2 CPU workers, fp32, greedy: ``chat.completions.parse`` with a pydantic model,
``json_schema`` (a subset of ``structured_cases``; all ten run through the pipeline in
``test_structured_pipeline.py``), ``json_object``, forced tool calls (``required`` and a named
function) for three tool sets, streamed and not, bad input as 400s, and constrained requests that
stay identical and valid when a worker is killed mid-run (recompute on the other worker).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal

import jsonschema
import openai
import pydantic
import pytest
from stack_harness import MODEL, openai_client, recovery_stack
from structured_cases import MAX_TOKENS, SCHEMA_CASES, TOOL_QUESTIONS, TOOL_SETS

pytestmark = pytest.mark.slow  # a stack of its own (about a minute to start on 2 shared cores)


@pytest.fixture(scope="module")
def stack(smollm2_source):
    with recovery_stack() as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack[1], max_retries=0)


def ask(client, question: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kwargs,
    )


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_returns_a_pydantic_object(client):
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": SCHEMA_CASES[0][0]}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_schema_and_json_object(client):
    cases = SCHEMA_CASES[1:4]
    with concurrent.futures.ThreadPoolExecutor(len(cases) + 1) as ex:
        futures = [ex.submit(ask, client, q, response_format=schema_format(s)) for q, s in cases]
        obj = ex.submit(ask, client, SCHEMA_CASES[0][0], response_format={"type": "json_object"})
        for f, (_, schema) in zip(futures, cases, strict=True):
            jsonschema.validate(json.loads(f.result().choices[0].message.content), schema)
        assert isinstance(json.loads(obj.result().choices[0].message.content), dict)


def _streamed_calls(stream) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("forced", ["required", "named"])
def test_forced_tool_calls_are_valid(client, stream, forced):
    for tools, question in zip(TOOL_SETS, TOOL_QUESTIONS, strict=True):
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        first = tools[0]["function"]["name"]
        choice = "required" if forced == "required" else {"type": "function", "function": {"name": first}}
        # one call: SmolLM2-135M repeats a call until max_tokens when parallel calls are allowed
        r = ask(client, question, tools=tools, tool_choice=choice, parallel_tool_calls=False, stream=stream)
        if stream:
            calls, reason = _streamed_calls(r)
        else:
            message = r.choices[0].message
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
            reason = r.choices[0].finish_reason
        assert reason == "tool_calls" and calls
        for call in calls:
            assert call["name"] in by_name and (forced == "required" or call["name"] == first)
            jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]])


WEATHER = TOOL_SETS[0]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(response_format=schema_format({"type": "nonsense"})), "json_schema"),
        (dict(extra_body={"guided_regex": "a(b"}), "regex"),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= nowhere"}}), "grammar"),
        (dict(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
        (dict(logit_bias={"5": 500}), "logit_bias"),
    ],
)
def test_bad_input_is_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", **kwargs)
    assert e.value.body["param"] == param


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "5C", "tool_call_id": "call_1"}],
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}
                ],
            },
        ],
        [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
    ],
    ids=["orphan-tool-result", "arguments-not-json", "call-without-function"],
)
def test_malformed_tool_messages_are_400(client, messages):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)


def test_tool_history_is_accepted(client):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "5 degrees and rain", "tool_call_id": "c1"},
        ],
        tools=WEATHER,
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_structured_output_survives_a_killed_worker(stack, client):
    cases = SCHEMA_CASES[:4]

    def run_all(disrupt=None):
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as ex:
            futures = [ex.submit(ask, client, q, response_format=schema_format(s)) for q, s in cases]
            if disrupt is not None:
                probe = ask(client, "Count slowly:", stream=True)
                for _ in probe:  # its first token: passes are running (CPU workers send up to 3 a chunk)
                    break
                probe.close()
                assert any(not f.done() for f in futures), "the kill came after every request finished"
                disrupt()
            return [f.result(timeout=240).choices[0].message.content for f in futures]

    baseline = run_all()
    worker = next(p for n, p in stack[0].procs if n == "worker-0")
    got = run_all(lambda: worker.send_signal(signal.SIGKILL))
    assert got == baseline
    for text, (_, schema) in zip(got, cases, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_logit_bias_reaches_the_worker(client, smollm2_source):
    tok = smollm2_source.load_tokenizer()
    word = tok.encode(" yes", add_special_tokens=False)[0]
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(word): 100}
    )
    assert r.choices[0].text == tok.decode([word] * 4)
