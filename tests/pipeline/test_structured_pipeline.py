"""Structured output through the in-process pipeline on SmolLM2-135M (CPU, fp32, greedy).

Every schema of ``structured_cases.SCHEMA_CASES`` gives a document that ``jsonschema`` accepts;
regex and choice constrain the text; a constrained request is identical when preemptions force
recomputes (the matcher is rebuilt from the recomputed tokens) and with overlap on or off; an
uncompilable spec is an ``InvalidRequestError`` before anything runs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pipeline_harness import chat, pipelines, run_concurrently
from structured_cases import MAX_TOKENS, SCHEMA_CASES

from fuseserve.errors import InvalidRequestError

GREEDY = dict(temperature=0.0, max_new_tokens=MAX_TOKENS)


def test_ten_schemas_validate(pipe):
    calls = [lambda q=q, s=s: pipe(chat(pipe, q), json_schema=s, **GREEDY)[0] for q, s in SCHEMA_CASES]
    for (_, schema), out in zip(SCHEMA_CASES, run_concurrently(calls), strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice(pipe):
    ids = chat(pipe, "Give me an email address.")
    email, yes_no = run_concurrently(
        [
            lambda: pipe(ids, regex=r"[a-z]{1,8}@[a-z]{1,8}\.com", **GREEDY)[0],
            lambda: pipe(chat(pipe, "Is water wet?"), choice=["yes", "no"], **GREEDY)[0],
        ]
    )
    assert re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.com", email.text) and email.finish_reason == "stop"
    assert yes_no.text in ("yes", "no")


@pytest.mark.parametrize(
    "overlap", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["overlap", "serial"]
)
def test_preempted_structured_output_is_identical(request, overlap):
    roomy = request.getfixturevalue("pipe" if overlap else "pipe_serial")
    tiny = pipelines(request, True)[1]  # overlap on: the recompute path under test is the worker's
    cases = SCHEMA_CASES[:5]
    prompts = [chat(roomy, q) for q, _ in cases]
    ref = run_concurrently(
        [
            lambda p=p, s=s: roomy(p, json_schema=s, **GREEDY)[0]
            for p, (_, s) in zip(prompts, cases, strict=True)
        ]
    )
    before = tiny.scheduler.num_preemptions
    got = run_concurrently(
        [
            lambda p=p, s=s: tiny(p, json_schema=s, **GREEDY)[0]
            for p, (_, s) in zip(prompts, cases, strict=True)
        ]
    )
    assert tiny.scheduler.num_preemptions > before, "the tiny KV pool should have forced preemptions"
    for g, r, (_, schema) in zip(got, ref, cases, strict=True):
        assert g.token_ids == r.token_ids
        jsonschema.validate(json.loads(g.text), schema)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(json_schema={"type": "nonsense"}), "json_schema"),
        (dict(regex="a(b"), "regex"),
        (dict(grammar="root ::= missing"), "grammar"),
    ],
)
def test_uncompilable_spec_is_rejected(pipe, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        pipe([1, 2, 3], max_new_tokens=4, **kwargs)
    assert e.value.param == param
