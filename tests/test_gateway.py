"""The gateway against a real Redis and a fake scheduler (``tests/gateway_harness.py``), served by uvicorn.

The fake scheduler echoes each prompt's token ids back as output, then a hidden EOS ("stop"), or
stops at max_tokens ("length"); so expected texts are the prompt's own decode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from gateway_harness import EOS, FakeScheduler, ServedApp

from fuseserve.gateway.admission import Admission
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.messages import CONTROL, ControlMessage
from fuseserve.redis_launcher import find_redis_server, free_port, launch_redis

MODEL = "smollm2-135m-instruct"
MAX_BODY = 64 * 1024
MAX_QUEUE = 8
GRACE_S = 1.0  # seconds without a scheduler heartbeat before requests in flight fail


@pytest.fixture(scope="module")
def redis_server():
    with launch_redis() as server:
        yield server


@pytest.fixture(scope="module")
def fake(redis_server):
    sched = FakeScheduler(redis_server.url)
    yield sched
    sched.close()


@pytest.fixture(autouse=True)
def _reset_fake(fake):
    yield
    fake.token_delay, fake.error_next, fake.error_after, fake.duplicate = 0.0, None, None, False
    if fake.dead:
        fake.revive()
    fake.add_worker()
    fake.set_waiting(0)


@pytest.fixture(scope="module")
def app(redis_server, smollm2_source, fake):
    settings = GatewaySettings(
        redis_server.url,
        source=smollm2_source,
        max_body_bytes=MAX_BODY,
        max_queue=MAX_QUEUE,
        admission_cache_s=0,
        disconnect_poll_s=0.1,
        scheduler_grace_s=GRACE_S,
        scheduler_check_s=0.2,
    )
    return create_app(settings)


@pytest.fixture(scope="module")
def server(app):
    served = ServedApp(app)
    yield served
    served.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=20) as client:
        yield client


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def post(http, path, **body):
    return http.post(path, json={"model": MODEL, **body})


def sse_events(http, path, **body) -> list:
    """All ``data:`` payloads of a streamed request (JSON decoded, "[DONE]" kept as is)."""
    out = []
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_works(http):
    r = post(http, "/v1/completions", prompt="Still working?", max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Still working"


def assert_error(r, status: int, param: str | None = None, contains: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err["message"]
    return err


# --------------------------------------------------------------------------- plain endpoints
def test_models_health_metrics(http, fake):
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert http.get("/health").json() == {"status": "ok", "workers": 1}
    text = http.get("/metrics").text
    for name in (
        "fuseserve_requests_total",
        "fuseserve_request_latency_seconds",
        "fuseserve_ttft_seconds",
        "fuseserve_inter_token_latency_seconds",
        "fuseserve_generated_tokens_total",
        "fuseserve_prompt_tokens_total",
        "fuseserve_queue_depth",
    ):
        assert name in text


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
    }
    # max_tokens defaults to what fits the context
    assert fake.requests[-1].params["max_new_tokens"] == 8192 - len(ids)

    body = post(http, "/v1/completions", prompt=prompt, max_tokens=3, temperature=0, seed=1).json()
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
    deadline = time.monotonic() + 2
    while not fake.aborts_for([sid]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.aborts_for([sid])[0].reason == "stop"
    events = sse_events(http, "/v1/completions", prompt=prompt, stop=" four")
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "one two three"
    body = post(http, "/v1/completions", prompt=prompt, stop=" four", include_stop_str_in_output=True).json()
    assert body["choices"][0]["text"] == "one two three four"


def test_duplicate_events_are_dropped(http, fake):
    fake.duplicate = True
    body = post(http, "/v1/completions", prompt="no doubled words").json()
    assert body["choices"][0]["text"] == "no doubled words"


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
    ({"prompt": "x", "echo": True}, 400, "echo", ""),
    ({"prompt": "x", "best_of": 2}, 400, "best_of", "best_of"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
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
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, **body}), 400, param)
    assert_works(http)


def test_model_field_required(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "model")


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_works(http)


def test_prompt_over_context_names_the_numbers(http, tok):
    ids = [tok("hello")["input_ids"][0]] * 8000
    err = assert_error(post(http, "/v1/completions", prompt=ids, max_tokens=500), 400, "max_tokens")
    assert "8192" in err["message"] and "8000" in err["message"] and "500" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = assert_error(post(http, "/v1/completions", prompt=[ids[0]] * 8192), 400, "prompt", "8192")
    assert_works(http)


def test_body_too_large(http):
    r = post(http, "/v1/completions", prompt="x" * (MAX_BODY + 10))
    assert_error(r, 413, contains=str(MAX_BODY))

    def chunks():  # no Content-Length: the size is counted while reading
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413)
    assert_works(http)


def test_queue_full_429(http, fake):
    fake.set_waiting(MAX_QUEUE)
    r = post(http, "/v1/completions", prompt="x")
    assert_error(r, 429, contains=str(MAX_QUEUE))
    assert int(r.headers["retry-after"]) >= 1
    assert "fuseserve_queue_depth 8.0" in http.get("/metrics").text
    fake.set_waiting(MAX_QUEUE - 1)
    assert_works(http)


def test_no_worker_503(http, fake):
    fake.remove_worker()
    assert_error(post(http, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}]), 503)
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
    events = sse_events(http, "/v1/completions", prompt="x")
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
        closed_at = time.monotonic()
    sid = fake.requests[n_before].seq_id
    while not fake.aborts_for([sid]) and time.monotonic() - closed_at < 2:
        time.sleep(0.02)
    assert [a.reason for a in fake.aborts_for([sid])] == ["abort"]
    assert_works(http)


def test_client_disconnect_non_stream_aborts(server, fake, http):
    fake.token_delay = 0.02
    n_before = len(fake.requests)
    body = {"model": MODEL, "prompt": "tick tock", "ignore_eos": True, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as other:
        other.post("/v1/completions", json=body)
    closed_at = time.monotonic()
    sid = fake.requests[n_before].seq_id
    while not fake.aborts_for([sid]) and time.monotonic() - closed_at < 2:
        time.sleep(0.02)
    assert fake.aborts_for([sid]), "no abort within 2 s of the disconnect"
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
    assert values['fuseserve_requests_total{status="ok"}'] >= 10
    assert values['fuseserve_requests_total{status="client_error"}'] >= 20
    assert values['fuseserve_requests_total{status="abort"}'] >= 2
    assert values["fuseserve_generated_tokens_total"] > 0 and values["fuseserve_prompt_tokens_total"] > 0
    assert (
        values["fuseserve_ttft_seconds_count"] > 0
        and values["fuseserve_inter_token_latency_seconds_count"] > 0
    )


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


# --------------------------------------------------------------------------- robustness
def raw_post(http, path, body: dict):
    """POST ``body`` as ASCII JSON (``\\ud800`` escapes stay escapes; httpx's json= cannot send them)."""
    content = json.dumps({"model": MODEL, **body}).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_deeply_nested_json_is_400(http):
    depth = 30_000  # far past Python's recursion limit, under MAX_BODY
    r = http.post("/v1/completions", content=b"[" * depth + b"]" * depth)
    assert_error(r, 400, contains="not valid JSON")
    r = http.post(
        "/v1/completions", content=b'{"model": "x", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    )
    assert_error(r, 400, contains="not valid JSON")
    assert_works(http)  # same keep-alive connection


LONE_SURROGATES = [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "ok\ud800"}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "messages",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]}, "stop"),
]


@pytest.mark.parametrize("path,body,param", LONE_SURROGATES)
def test_lone_surrogates_are_400(http, path, body, param):
    assert_error(raw_post(http, path, body), 400, param)
    assert_works(http)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),  # the second sequence's seed would be 2**63
        ({"seed": 10**30}, "seed"),
        ({"stop_token_ids": [49152]}, "stop_token_ids"),  # the model's vocab_size
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2, 10**12]}, "stop_token_ids"),
    ],
)
def test_values_that_cannot_reach_the_worker_are_400(http, body, param):
    assert_error(post(http, "/v1/completions", prompt="x", **body), 400, param)
    assert_works(http)


def test_seed_and_stop_token_id_limits_are_accepted(http, fake):
    r = post(http, "/v1/completions", prompt="x", seed=2**63 - 2, n=2, stop_token_ids=[0, 49151])
    assert r.status_code == 200, r.text
    assert [m.params["seed"] for m in fake.requests[-2:]] == [2**63 - 2, 2**63 - 1]
    assert post(http, "/v1/completions", prompt="x", seed=-(2**63)).status_code == 200


def test_scheduler_error_after_tokens_streamed(http, fake):
    fake.error_after = (3, {"message": "worker lost", "type": "service_unavailable", "status": 503})
    events = sse_events(http, "/v1/completions", prompt="one two three four five six", max_tokens=50)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "worker lost" and events[-2]["error"]["status"] == 503
    assert "".join(c["choices"][0]["text"] for c in events[:-2] if c.get("choices")) == "one two three"
    assert_error(
        post(http, "/v1/completions", prompt="one two three four", max_tokens=50), 503, contains="lost"
    )


def test_admission_snapshot_is_single_flight():
    class Pipe:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        def exists(self, key):
            pass

        def get(self, key):
            pass

        async def execute(self):
            await asyncio.sleep(0.01)
            return [1, json.dumps({"waiting": 3, "time": time.time()})]

    class Redis:
        scans = 0

        async def scan_iter(self, match, count):
            Redis.scans += 1
            await asyncio.sleep(0.01)
            yield "fuseserve:worker:a"

        def pipeline(self, transaction):
            return Pipe()

    async def burst(admission, n):
        return await asyncio.gather(*(admission.snapshot() for _ in range(n)))

    admission = Admission(Redis(), max_queue=8, cache_s=0)
    snaps = asyncio.run(burst(admission, 200))
    assert Redis.scans == 1 and all(s is snaps[0] for s in snaps)
    assert (snaps[0].scheduler_alive, snaps[0].num_workers, snaps[0].waiting) == (True, 1, 3)
    asyncio.run(burst(admission, 10))
    assert Redis.scans == 2  # a later burst reads again


async def _burst(url: str, n: int, path: str = "/v1/completions") -> list[int]:
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        answers = await asyncio.gather(*(client.post(path, json=body) for _ in range(n)))
    return [a.status_code for a in answers]


def test_burst_of_requests_is_served(server, http):
    statuses = asyncio.run(_burst(server.url, 200))
    assert statuses == [200] * 200, {s: statuses.count(s) for s in set(statuses)}
    assert_works(http)


def test_overload_is_503_never_500(redis_server, smollm2_source, fake):
    settings = GatewaySettings(
        redis_server.url, source=smollm2_source, admission_cache_s=0,
        redis_max_connections=2, redis_pool_timeout_s=0.01,
    )  # fmt: skip
    served = ServedApp(create_app(settings))
    try:
        statuses = asyncio.run(_burst(served.url, 100))
        assert set(statuses) <= {200, 503} and 200 in statuses, {s: statuses.count(s) for s in set(statuses)}
    finally:
        served.close()


def test_scheduler_death(http, server, fake):
    fake.token_delay = 0.02
    body = {"model": MODEL, "prompt": "tick tock", "ignore_eos": True, "max_tokens": 5000}

    def stream():
        with httpx.Client(base_url=server.url, timeout=10) as other:
            return sse_events(other, "/v1/completions", **{k: v for k, v in body.items() if k != "model"})

    def plain():
        with httpx.Client(base_url=server.url, timeout=10) as other:
            return other.post("/v1/completions", json=body)

    with ThreadPoolExecutor(2) as pool:
        streamed, answered = pool.submit(stream), pool.submit(plain)
        time.sleep(0.3)  # both are generating
        fake.kill()
        killed_at = time.monotonic()
        assert http.get("/health").status_code == 503
        assert http.get("/health").json()["status"] == "no_scheduler"
        assert_error(post(http, "/v1/completions", prompt="x"), 503, contains="no scheduler")
        events, r = streamed.result(), answered.result()
    waited = time.monotonic() - killed_at
    assert GRACE_S - 0.1 <= waited < GRACE_S + 2, waited
    assert events[-1] == "[DONE]" and events[-2]["error"]["status"] == 503
    assert "no scheduler" in events[-2]["error"]["message"]
    assert len(events) > 3  # tokens came before the error
    assert_error(r, 503, contains="no scheduler")
    fake.revive()
    assert http.get("/health").json() == {"status": "ok", "workers": 1}
    assert_works(http)


def test_redis_outage_is_503_and_recovers(smollm2_source):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    def start_redis() -> subprocess.Popen:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return proc
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    proc = start_redis()
    settings = GatewaySettings(url, source=smollm2_source, admission_cache_s=0, scheduler_grace_s=GRACE_S)
    served = ServedApp(create_app(settings))
    sched = None
    try:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            sched = FakeScheduler(url)
            assert_works(client)
            sched.close()  # its heartbeat key lives on for SCHEDULER_TTL_S: a request still enters
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(post, client, "/v1/completions", prompt="waits")
                time.sleep(0.3)
                proc.terminate()
                proc.wait(5)
                for r in (client.get("/health"), post(client, "/v1/completions", prompt="x")):
                    assert assert_error(r, 503, contains="Redis")["type"] == "service_unavailable"
                assert_error(in_flight.result(), 503, contains="lost Redis")  # after GRACE_S
            proc = start_redis()
            sched = FakeScheduler(url)
            deadline = time.monotonic() + 5
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert_works(client)  # the router reads responses again
    finally:
        if sched is not None:
            sched.close()
        served.close()
        proc.terminate()
        proc.wait(5)


def test_client_gone_while_uploading_is_an_abort(http, server, caplog):
    aborts, errors = (
        metric(http, 'fuseserve_requests_total{status="abort"}'),
        metric(http, 'fuseserve_requests_total{status="error"}'),
    )
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO, logger="fuseserve"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + b'{"model": "' + MODEL.encode())
            time.sleep(0.1)
        deadline = time.monotonic() + 3
        while (
            metric(http, 'fuseserve_requests_total{status="abort"}') == aborts and time.monotonic() < deadline
        ):
            time.sleep(0.02)
    assert metric(http, 'fuseserve_requests_total{status="abort"}') == aborts + 1
    assert metric(http, 'fuseserve_requests_total{status="error"}') == errors
    mine = [r for r in caplog.records if r.name.startswith("fuseserve")]
    assert len(mine) <= 1 and all(r.levelno < logging.WARNING and not r.exc_info for r in mine), mine
    assert_works(http)
