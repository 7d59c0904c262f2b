"""The gateway against a real Redis and a fake scheduler (``tests/gateway_harness.py``), served by uvicorn.

The fake scheduler echoes each prompt's token ids back as output, then a hidden EOS ("stop"), or
stops at max_tokens ("length"); so expected texts are the prompt's own decode.
"""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_harness import EOS
from gateway_http import MAX_QUEUE, MODEL, assert_error, assert_works, post, sse_events
from stack_harness import wait_for

from fuseserve.messages import CONTROL, ControlMessage


# --------------------------------------------------------------------------- plain endpoints
def test_models_health_metrics(http, fake):
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL
    # the fp32 conversion is not quantized; the KV cache dtype is the (fake) worker record's
    assert card["quantization"] is None and card["kv_cache_dtype"] == "float8_e4m3fn"
    assert http.get("/health").json() == {"status": "ok", "workers": 1}
    head = http.head("/health")  # a load balancer's probe
    assert head.status_code == 200 and head.content == b""
    text = http.get("/metrics").text
    for name in (
        "fuseserve_http_requests_total",
        "fuseserve_e2e_request_latency_seconds",
        "fuseserve_time_to_first_token_seconds",
        "fuseserve_inter_token_latency_seconds",
        "fuseserve_generation_tokens_total",
        "fuseserve_prompt_tokens_total",
        "fuseserve_request_success_total",
        "fuseserve_num_requests_in_flight",
    ):
        assert name in text
    assert "fuseserve_queue_depth" not in text  # the scheduler's to export (one owner)


# --------------------------------------------------------------------------- completions
def test_completion_echo_usage_and_finish(http, tok, fake):
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tok(prompt)["input_ids"]
    body = post(http, "/v1/completions", prompt=prompt).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert choice["text"] == prompt and choice["finish_reason"] == "stop"
    # the hidden EOS counts in usage but not in the text
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(ids) + 1,
        "total_tokens": 2 * len(ids) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},  # the fake scheduler caches nothing
    }
    # max_tokens defaults to what fits the context
    assert fake.requests[-1].params["max_new_tokens"] == 8192 - len(ids)

    assert fake.requests[-1].cache_salt is None
    body = post(
        http, "/v1/completions", prompt=prompt, max_tokens=3, temperature=0, seed=1, cache_salt="t1"
    ).json()
    assert fake.requests[-1].cache_salt == "t1"  # forwarded to the scheduler (prefix-cache isolation)
    assert body["choices"][0]["text"] == tok.decode(ids[:3])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_completion_prompt_forms_and_n(http, tok):
    ids = tok("Hello there")["input_ids"]
    assert post(http, "/v1/completions", prompt=ids).json()["choices"][0]["text"] == "Hello there"
    body = post(http, "/v1/completions", prompt=["A cat", "Hello there"], max_tokens=5).json()
    assert [c["text"] for c in body["choices"]] == ["A cat", "Hello there"]
    assert post(http, "/v1/completions", prompt=["A cat", ids]).status_code == 400  # not an OpenAI shape
    body = post(http, "/v1/completions", prompt=[ids, ids[:1]], n=2, seed=7).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["Hello there"] * 2 + [tok.decode(ids[:1])] * 2
    assert body["usage"]["prompt_tokens"] == len(ids) + 1  # once per prompt, not per n


def test_completion_n_seeds_offset(http, fake):
    post(http, "/v1/completions", prompt="x", n=3, seed=10)
    assert [m.params["seed"] for m in fake.requests[-3:]] == [10, 11, 12]


def test_stream_equals_non_stream_and_include_usage(http):
    prompt = "Streaming text with ünïcödé and emoji 🎉 pieces."
    whole = post(http, "/v1/completions", prompt=prompt).json()
    events = sse_events(http, "/v1/completions", prompt=prompt, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"] == prompt
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = sse_events(http, "/v1/completions", prompt=prompt)
    assert all("usage" not in c for c in plain[:-1])


def test_stop_string_cuts_text_and_aborts(http, fake):
    prompt = "one two three four five six seven eight"
    body = post(http, "/v1/completions", prompt=prompt, stop=[" four", "nine"]).json()
    assert body["choices"][0]["text"] == "one two three"
    assert body["choices"][0]["finish_reason"] == "stop"
    sid = fake.requests[-1].seq_id
    wait_for(lambda: fake.aborts_for([sid]), 30, "the abort of the stopped sequence")
    assert fake.aborts_for([sid])[0].reason == "stop"
    events = sse_events(http, "/v1/completions", prompt=prompt, stop=" four")
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "one two three"
    body = post(http, "/v1/completions", prompt=prompt, stop=" four", include_stop_str_in_output=True).json()
    assert body["choices"][0]["text"] == "one two three four"


def metric_values(http) -> dict[str, float]:
    """Every series of the gateway's /metrics: ``'name{labels}'`` → value."""
    text = http.get("/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and line[0] != "#"
    }


def test_duplicate_events_are_dropped(http, fake):
    fake.duplicate = True  # as a scheduler resends after a failover
    tokens, stops = (
        f'fuseserve_generation_tokens_total{{model_name="{MODEL}"}}',
        f'fuseserve_request_success_total{{finished_reason="stop",model_name="{MODEL}"}}',
    )
    before = metric_values(http)
    body = post(http, "/v1/completions", prompt="no doubled words").json()
    assert body["choices"][0]["text"] == "no doubled words"
    after = metric_values(http)
    assert after[tokens] - before[tokens] == body["usage"]["completion_tokens"]  # counted once
    assert after[stops] - before[stops] == 1


def test_completion_logprobs_and_token_ids(http, tok):
    ids = tok("log probs")["input_ids"]
    body = post(http, "/v1/completions", prompt=ids, logprobs=2, return_token_ids=True).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"] == [-0.25] * len(ids)
    assert all(len(d) == 2 for d in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    assert choice["token_ids"] == ids + [EOS]
    assert choice["prompt_tokens"] == len(ids)
    assert choice["top_logprob_ids"][0] == [[ids[0], -0.25], [ids[0] + 1, -1.5]]
    assert post(http, "/v1/completions", prompt=ids).json()["choices"][0]["logprobs"] is None


# --------------------------------------------------------------------------- chat
def test_chat_stream_and_non_stream(http, tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    body = post(http, "/v1/chat/completions", messages=messages).json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == tok.decode(ids, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(ids)
    events = sse_events(
        http, "/v1/chat/completions", messages=messages, stream_options={"include_usage": True}
    )
    chunks = [c for c in events[:-1] if c["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"] == body["usage"]
    # content as text parts
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    assert post(http, "/v1/chat/completions", messages=parts).json()["choices"][0]["message"] == msg


def test_chat_logprobs_shape(http):
    messages = [{"role": "user", "content": "Hi"}]
    body = post(
        http, "/v1/chat/completions", messages=messages, max_tokens=4, logprobs=True, top_logprobs=3
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    r = post(http, "/v1/chat/completions", messages=messages, top_logprobs=3)
    assert_error(r, 400, "top_logprobs")


# --------------------------------------------------------------------------- bad input
BAD_COMPLETIONS = [
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": []}, 400, "prompt", ""),
    ({"prompt": [[]]}, 400, "prompt", "empty"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ""),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens", ""),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", ""),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", ""),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", ""),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", ""),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", ""),
    ({"prompt": 5}, 400, "prompt", ""),
    ({"prompt": [1, "a"]}, 400, "prompt", ""),
    ({"prompt": [10**9]}, 400, "prompt", "outside"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", ""),
    ({"prompt": "x", "n": 0}, 400, "n", ""),
    ({"prompt": "x", "echo": True, "stream": True}, 400, "echo", "stream"),
    ({"prompt": "x", "echo": True, "max_tokens": -1}, 400, "max_tokens", ""),
    ({"prompt": "x", "best_of": 2}, 400, "best_of", "best_of"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    ({"prompt": "x", "max_tokens": 9000}, 400, "max_tokens", "8192"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ({"max_tokens": 3}, 400, "prompt", "prompt"),
]


@pytest.mark.parametrize("body,status,param,contains", BAD_COMPLETIONS)
def test_bad_completion_requests(http, body, status, param, contains):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert_error(r, status, param, contains)
    assert_works(http)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    # structured output and tools (docs/structured_output.md): rejected before the scheduler sees them
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "a(b"}, "regex"),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "nonsense"}},
            },
        },
        "json_schema",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, **body}), 400, param)
    assert_works(http)


def test_constraints_reach_the_scheduler(http, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    r = post(
        http,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "x"}],
        logit_bias={"5": -100},
        **body,
    )
    assert r.status_code == 200, r.text
    params = fake.requests[-1].params
    assert json.loads(params["json_schema"]) == schema and params["logit_bias"] == {"5": -100}
    post(http, "/v1/completions", prompt="x", structured_outputs={"choice": ["a", "b"]})
    assert fake.requests[-1].params["choice"] == ["a", "b"]


def test_request_field_policy(http):
    """vLLM's policy: no-op fields accepted; unknown ones accepted and named in a header;
    known output-changing fields that are not implemented are a 400 naming them."""
    noop = dict(
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        prompt_cache_key="c",
        safety_identifier="s",
        stream_options={"include_obfuscation": False},
        parallel_tool_calls=True,
    )
    messages = [{"role": "user", "content": "hi"}]
    r = post(http, "/v1/chat/completions", messages=messages, max_tokens=2, **noop)
    assert r.status_code == 200, r.text
    assert "x-fuseserve-ignored-fields" not in r.headers
    r = post(http, "/v1/completions", prompt="x", max_tokens=2, frobnicate=1, another={"a": 1})
    assert r.status_code == 200, r.text
    assert r.headers["x-fuseserve-ignored-fields"] == "another,frobnicate"
    r = post(http, "/v1/completions", prompt="x", max_tokens=2, stream=True, frobnicate=1)
    assert r.headers["x-fuseserve-ignored-fields"] == "frobnicate"
    for name, value in (("reasoning_effort", "low"), ("audio", {"voice": "x"})):
        assert_error(post(http, "/v1/chat/completions", messages=messages, **{name: value}), 400, name, name)


def test_model_field_required(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "model")


def test_prompt_over_context_names_the_numbers(http, tok):
    ids = [tok("hello")["input_ids"][0]] * 8000
    err = assert_error(post(http, "/v1/completions", prompt=ids, max_tokens=500), 400, "max_tokens")
    assert "8192" in err["message"] and "8000" in err["message"] and "500" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = assert_error(post(http, "/v1/completions", prompt=[ids[0]] * 8192), 400, "prompt", "8192")
    assert_works(http)


def test_queue_full_429(http, fake):
    fake.set_waiting(MAX_QUEUE)
    r = post(http, "/v1/completions", prompt="x")
    assert_error(r, 429, contains=str(MAX_QUEUE))
    assert int(r.headers["retry-after"]) >= 1
    fake.set_waiting(MAX_QUEUE - 1)
    assert_works(http)


def test_no_worker_503(http, fake):
    fake.remove_worker()
    r = post(http, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}])
    assert_error(r, 503)
    assert int(r.headers["retry-after"]) >= 1
    assert http.get("/health").status_code == 503
    fake.add_worker()
    assert http.get("/health").status_code == 200
    assert_works(http)


def test_unknown_route_and_method_are_openai_json(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


# --------------------------------------------------------------------------- scheduler errors, disconnects
def test_scheduler_error_event(http, fake):
    fake.error_next = {
        "message": "prompt too long for any worker",
        "type": "invalid_request_error",
        "status": 400,
    }
    assert_error(post(http, "/v1/completions", prompt="x"), 400, contains="too long")
    fake.error_next = {"message": "worker lost", "type": "server_error", "status": 503}
    failed = f'fuseserve_request_success_total{{finished_reason="error",model_name="{MODEL}"}}'
    before = metric_values(http)[failed]
    events = sse_events(http, "/v1/completions", prompt="x")
    assert metric_values(http)[failed] == before + 1  # the HTTP status was 200: counted as an error here
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "worker lost" and events[-2]["error"]["status"] == 503
    assert_works(http)


def test_client_disconnect_mid_stream_aborts(http, server, fake):
    fake.token_delay = 0.02
    n_before = len(fake.requests)
    with httpx.Client(base_url=server.url, timeout=10) as other:
        body = {"model": MODEL, "prompt": "tick tock", "ignore_eos": True, "max_tokens": 2000, "stream": True}
        with other.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
    sid = fake.requests[n_before].seq_id
    wait_for(lambda: fake.aborts_for([sid]), 30, "the abort of the disconnected stream")
    assert [a.reason for a in fake.aborts_for([sid])] == ["abort"]
    assert_works(http)


def test_client_disconnect_non_stream_aborts(server, fake, http):
    fake.token_delay = 0.02
    n_before = len(fake.requests)
    body = {"model": MODEL, "prompt": "tick tock", "ignore_eos": True, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as other:
        other.post("/v1/completions", json=body)
    sid = fake.requests[n_before].seq_id
    wait_for(lambda: fake.aborts_for([sid]), 30, "the abort of the disconnected request")
    assert_works(http)


def test_abort_messages_are_on_the_control_stream(fake):
    entries = fake.r.xrange(CONTROL)
    assert entries and all(ControlMessage.decode(f).kind == "abort" for _id, f in entries)


def test_metrics_count_outcomes(http):
    text = http.get("/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    m = f'model_name="{MODEL}"'
    assert values[f'fuseserve_http_requests_total{{{m},status="200"}}'] >= 10
    assert values[f'fuseserve_http_requests_total{{{m},status="400"}}'] >= 20
    assert values[f'fuseserve_request_success_total{{finished_reason="abort",{m}}}'] >= 2
    assert values[f'fuseserve_request_success_total{{finished_reason="stop",{m}}}'] >= 5
    assert values[f"fuseserve_generation_tokens_total{{{m}}}"] > 0
    assert values[f"fuseserve_prompt_tokens_total{{{m}}}"] > 0
    assert values[f"fuseserve_time_to_first_token_seconds_count{{{m}}}"] > 0
    assert values[f"fuseserve_inter_token_latency_seconds_count{{{m}}}"] > 0
    assert values[f"fuseserve_num_requests_in_flight{{{m}}}"] == 0


# --------------------------------------------------------------------------- the official openai package
def test_openai_package(server, tok):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Paris is nice", max_tokens=10)
    assert out.choices[0].text == "Paris is nice" and out.usage.completion_tokens == 4
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="Paris is nice", stream=True)
        if c.choices
    ]
    assert "".join(pieces) == "Paris is nice"
    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert [m.id for m in client.models.list()] == [MODEL]
