"""One suite, two modes: the same cases through the pipeline and through the stack (``fuseserve
serve``: Redis, scheduler, 2 gRPC workers, gateway) give the same text, token ids, finish reasons,
logprobs and usage, and the same typed errors. fp32 on both sides.

The stack is driven by ``fuseserve.Client`` (the pipeline's keywords over the OpenAI API) and, for
the OpenAI surface itself, by the official ``openai`` package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from stack_harness import MODEL, openai_client

import fuseserve
from fuseserve.errors import InvalidRequestError

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Case:
    """A request: ``prompt`` (text or ids) or ``messages`` (chat), with pipeline keywords."""

    name: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    kwargs: dict = field(default_factory=dict)

    def run(self, mode):
        if self.messages is not None:
            return mode.chat(self.messages, **self.kwargs)
        call = mode if isinstance(mode, fuseserve.Pipeline) else mode.generate
        (out,) = call(self.prompt, **self.kwargs)
        return out


CASES = [
    Case("text-length", "The capital of France is", kwargs=dict(max_new_tokens=12, temperature=0.0)),
    Case(
        "ids-logprobs",
        [504, 3575, 282, 4649, 314],
        kwargs=dict(max_new_tokens=6, temperature=0.0, logprobs=3),
    ),
    Case("chat-eos", messages=CAPITAL, kwargs=dict(max_new_tokens=48, temperature=0.0)),
    Case(
        "chat-stop-string", messages=CAPITAL, kwargs=dict(max_new_tokens=48, temperature=0.0, stop=["Paris"])
    ),
    Case(
        "stop-string-kept",
        messages=CAPITAL,
        kwargs=dict(max_new_tokens=48, temperature=0.0, stop=["Paris"], include_stop_str_in_output=True),
    ),
    Case("seeded", "Once upon a time", kwargs=dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7)),
    Case(
        "stop-token-id", "1, 2, 3, 4,", kwargs=dict(max_new_tokens=16, temperature=0.0, stop_token_ids=[28])
    ),
    Case(
        "ignore-eos-penalties",
        messages=CAPITAL,
        kwargs=dict(
            max_new_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, min_new_tokens=4
        ),
    ),
]

ERRORS = [
    ("empty-text", "", {}, "prompt"),
    ("empty-ids", [], {}, "prompt"),
    ("id-outside-vocab", [10**6], {}, "prompt"),
    ("context", "hello", {"max_new_tokens": 9000}, "max_tokens"),
    ("bad-temperature", "hello", {"temperature": -1.0}, "temperature"),
]


@pytest.fixture(scope="module")
def client(stack):
    with fuseserve.Client(stack[1], timeout=300) as c:
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_output_in_both_modes(pipe, client, case):
    a, b = case.run(pipe), case.run(client)
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    assert (b.prompt_tokens, b.generated_tokens) == (a.prompt_tokens, a.generated_tokens)
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert [[t.token_id for t in top] for top in b.top_logprobs] == [
        [t.token_id for t in top] for top in a.top_logprobs
    ]
    assert a.token_ids and a.prompt_tokens > 0
    if "stop" in case.kwargs:
        assert a.finish_reason == "stop" and ("Paris" in a.text) == case.kwargs.get(
            "include_stop_str_in_output", False
        )
    if case.kwargs.get("logprobs"):
        assert len(a.logprobs) == len(a.token_ids) and all(len(t) == 3 for t in a.top_logprobs)


@pytest.mark.parametrize("prompt,kwargs,param", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_same_errors_in_both_modes(pipe, client, prompt, kwargs, param):
    for mode in (pipe, client.generate):
        with pytest.raises(InvalidRequestError) as e:
            mode(prompt, **kwargs)
        assert e.value.param == param, (mode, e.value)


def test_openai_sdk_no_op_fields_and_bad_input(stack):
    """With the ``openai`` package: ``user``, ``metadata``, ``store`` are accepted; bad input is a 4xx."""
    import openai

    client = openai_client(stack[1])
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        max_tokens=8,
        temperature=0,
        user="u-1",
        metadata={"k": "v"},
        store=False,
    )
    assert r.choices[0].message.content
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body={"frobnicate": 1}
    )
    assert raw.headers["x-fuseserve-ignored-fields"] == "frobnicate"
    for bad in (
        dict(prompt=""),
        dict(prompt="x", max_tokens=10**6),
        dict(prompt="x", extra_body={"suffix": "y"}),
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, **{"max_tokens": 2, **bad})


def test_openai_sdk_models_retrieve(stack):
    client = openai_client(stack[1])
    assert client.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_echo_logprobs_score_the_prompt_as_transformers(stack, pipe, smollm2_source):
    """lm-eval's loglikelihood request (echo + logprobs, max_tokens 0) against transformers, fp32,
    with the prompt longer than the token budget (scored over several chunks); the pipeline's
    ``prompt_logprobs``, run next to a generating request, give the same numbers."""
    import torch
    from pipeline_harness import run_concurrently
    from transformers import AutoModelForCausalLM

    text = " ".join(
        f"Question {i}: What is the capital of {c}? Answer: The capital of {c} is {a}."
        for i, (c, a) in enumerate(
            [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Peru", "Lima")]
        )
    )
    ids = pipe.tokenizer(text)["input_ids"]
    assert len(ids) > 64  # the token budget: several chunks
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_source.path), dtype=torch.float32)
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(rows[p - 1, ids[p]]) for p in range(1, len(ids))]
    r = openai_client(stack[1]).completions.create(
        model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2
    )
    choice = r.choices[0]
    assert choice.text == text and r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    top = rows[len(ids) // 2 - 1].topk(2)
    assert list(choice.logprobs.top_logprobs[len(ids) // 2].values()) == pytest.approx(
        top.values.tolist(), abs=1e-4
    )
    got, _ = run_concurrently(
        [
            lambda: pipe(ids, max_new_tokens=1, temperature=0.0, prompt_logprobs=2)[0].prompt_logprobs,
            lambda: pipe("Count to twenty: 1, 2, 3,", max_new_tokens=24, temperature=0.0),
        ]
    )
    assert len(got) == len(ids) and got[0] is None and [e.token_id for e in got[1:]] == ids[1:]
    assert [e.logprob for e in got[1:]] == pytest.approx(expected, abs=1e-4)
    assert [t.token_id for t in got[len(ids) // 2].top] == top.indices.tolist()
    assert pipe(ids[:5], max_new_tokens=1, temperature=0.0)[0].prompt_logprobs is None
