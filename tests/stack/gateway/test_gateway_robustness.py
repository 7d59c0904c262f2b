"""Gateway robustness against a real Redis and a fake scheduler (``tests/gateway_harness.py``).

Malformed and oversized bodies, lone surrogates, values outside the wire ranges, scheduler errors
and death, bursts and overload, a Redis outage, a client gone mid-upload: each is answered with an
OpenAI-style error (never a 500) and the gateway keeps serving.
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
import redis
from gateway_harness import FakeScheduler, ServedApp
from gateway_http import GRACE_S, MAX_BODY, MODEL, assert_error, assert_works, post, sse_events
from stack_harness import wait_for

from fuseserve.gateway.admission import Admission
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.messages import REQUESTS, SCHEDULER_STATS_PATTERN
from fuseserve.redis_launcher import find_redis_server, free_port


# --------------------------------------------------------------------------- malformed bodies
@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
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


# --------------------------------------------------------------------------- robustness
def raw_post(http, path, body: dict):
    """POST ``body`` as ASCII JSON (``\\ud800`` escapes stay escapes; httpx's json= cannot send them)."""
    content = json.dumps({"model": MODEL, **body}).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def metric(http, name: str) -> float:
    """A series' value (0 when it does not exist yet: a label child is made on first use)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def server_errors(http) -> float:
    """HTTP 5xx answers so far."""
    return sum(
        float(line.split()[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith("fuseserve_http_requests_total{") and 'status="5' in line
    )


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


def test_lone_surrogate_model_is_404(http):
    """The 404 echoes the model name: its body is ASCII JSON, so the surrogate cannot make it a 500."""
    r = http.post(
        "/v1/completions",
        content=json.dumps({"model": "\ud800", "prompt": "x"}).encode(),
        headers={"content-type": "application/json"},
    )
    assert_error(r, 404, "model")
    assert_works(http)


def test_unknown_field_names_that_cannot_be_a_header(http):
    """A newline, NUL or non-Latin-1 field name once closed the connection (h11 refused the header) or
    gave a 500; 10 000 names made a 58 KB header. Only header-safe names are listed, 16 at most."""
    r = post(
        http,
        "/v1/completions",
        prompt="x",
        max_tokens=2,
        **{"a\nb": 1, "n\x00ul": 2, "\U0001f642": 3, "ok": 4},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-fuseserve-ignored-fields"] == "ok,(+3 more)"
    r = post(http, "/v1/completions", prompt="x", max_tokens=2, stream=True, **{"a\rb": 1})
    assert r.status_code == 200 and r.headers["x-fuseserve-ignored-fields"] == "(+1 more)"
    r = post(http, "/v1/completions", prompt="x", max_tokens=2, **{f"f{i:04d}": i for i in range(1000)})
    assert r.status_code == 200, r.text
    shown = r.headers["x-fuseserve-ignored-fields"].split(",")
    assert shown[:2] == ["f0000", "f0001"] and len(shown) == 17 and shown[-1] == "(+984 more)"
    assert_works(http)


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
        ({"top_k": 2**31}, "top_k"),  # int32 on the wire: it once failed every request of the pass
        ({"top_k": 10**12}, "top_k"),
    ],
)
def test_values_that_cannot_reach_the_worker_are_400(http, body, param):
    assert_error(post(http, "/v1/completions", prompt="x", **body), 400, param)
    assert_works(http)


def test_null_means_the_default_and_best_of_n_is_n(http, fake):
    """OpenAI's schema has n, stream, echo and logprobs nullable: null is the default, as there.
    best_of equal to n asks for what n gives; any other best_of is still a 400."""
    nulls = {"n": None, "stream": None, "echo": None, "logprobs": None, "return_token_ids": None}
    r = post(http, "/v1/completions", prompt="Hello", max_tokens=2, **nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and fake.requests[-1].params["logprobs"] is None
    messages = [{"role": "user", "content": "Hi"}]
    r = post(
        http, "/v1/chat/completions", messages=messages, max_tokens=2, n=None, stream=None, logprobs=None
    )
    assert r.status_code == 200, r.text
    for body in ({"best_of": 1}, {"best_of": 2, "n": 2}):
        r = post(http, "/v1/completions", prompt="Hello", max_tokens=2, **body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == body.get("n", 1)
    for body in ({"best_of": 2}, {"best_of": 1, "n": 2}, {"best_of": True}):
        assert_error(post(http, "/v1/completions", prompt="x", **body), 400, "best_of")


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user"}], "messages[0]: content is required for role 'user'"),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}],
            "messages[1]: content is",
        ),
        ([{"role": "user", "content": []}], "empty list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://h/i.png"}}]}],
            "'image_url'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
            "'input_audio'",
        ),
    ],
)
def test_chat_content_rules(http, messages, says):
    """Content as OpenAI requires it, each refusal naming the message: never a prompt rendered from
    nothing, never a parse error about strings for an image part."""
    r = post(http, "/v1/chat/completions", messages=messages, max_tokens=2)
    assert_error(r, 400, "messages", contains=says)


def test_assistant_turn_may_have_no_content(http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    assert post(http, "/v1/chat/completions", messages=messages, max_tokens=2).status_code == 200


VLLM_CHANGES = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("prompt_logprobs", 1),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("truncate_prompt_tokens", 4),
    ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": True}),
]


@pytest.mark.parametrize(("name", "value"), VLLM_CHANGES)
def test_vllm_fields_that_would_change_the_output_are_400(http, name, value):
    """vLLM's extensions fuseserve does not implement: a value that would change the output is
    refused naming the field (it was ignored, the output silently not what was asked)."""
    messages = [{"role": "user", "content": "Hi"}]
    assert_error(
        post(http, "/v1/chat/completions", messages=messages, max_tokens=2, **{name: value}), 400, name
    )


def test_vllm_defaults_sent_as_they_are_change_nothing(http, fake):
    """What a vLLM client sends by default is accepted, and named in no ignored-fields header."""
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "prompt_logprobs": None,
        "allowed_token_ids": None,
        "bad_words": [],
        "truncate_prompt_tokens": None,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "chat_template": None,
        "chat_template_kwargs": {},
    }
    messages = [{"role": "user", "content": "Hi"}]
    r = post(http, "/v1/chat/completions", messages=messages, max_tokens=2, **defaults)
    assert r.status_code == 200, r.text
    assert "x-fuseserve-ignored-fields" not in r.headers


def test_seed_and_stop_token_id_limits_are_accepted(http, fake):
    r = post(http, "/v1/completions", prompt="x", seed=2**63 - 2, n=2, stop_token_ids=[0, 49151])
    assert r.status_code == 200, r.text
    assert [m.params["seed"] for m in fake.requests[-2:]] == [2**63 - 2, 2**63 - 1]
    assert post(http, "/v1/completions", prompt="x", seed=-(2**63)).status_code == 200


@pytest.mark.parametrize("burst", [False, True], ids=["event_by_event", "one_batch"])
def test_scheduler_error_after_tokens_streamed(http, fake, burst):
    fake.burst = burst  # one_batch: the tokens and the error reach the gateway in one read
    fake.error_after = (3, {"message": "worker lost", "type": "service_unavailable", "status": 503})
    events = sse_events(http, "/v1/completions", prompt="one two three four five six", max_tokens=50)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "worker lost" and events[-2]["error"]["status"] == 503
    assert "".join(c["choices"][0]["text"] for c in events[:-2] if c.get("choices")) == "one two three"
    r = post(http, "/v1/completions", prompt="one two three four", max_tokens=50)
    assert_error(r, 503, contains="lost")
    assert int(r.headers["retry-after"]) >= 1  # a scheduler's 503 (no worker) tells when to retry


def test_admission_snapshot_is_single_flight():
    class Pipe:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        def exists(self, key):
            pass

        def mget(self, keys):
            pass

        async def execute(self):
            await asyncio.sleep(0.01)
            return [1, [json.dumps({"waiting": 3, "time": time.time()})]]

    class Redis:
        scans = 0  # refreshes: scans of the worker records

        async def scan_iter(self, match, count):
            await asyncio.sleep(0.01)
            if match == SCHEDULER_STATS_PATTERN:
                yield "fuseserve:scheduler:stats:s1"
                return
            Redis.scans += 1
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

    n_before = len(fake.requests)
    with ThreadPoolExecutor(2) as pool:
        streamed, answered = pool.submit(stream), pool.submit(plain)
        wait_for(
            lambda: (
                len(fake.requests) == n_before + 2
                and all(fake.num_sent(m.seq_id) > 3 for m in fake.requests[n_before:])
            ),
            30,
            "both requests generating",
        )
        killed_at = time.monotonic()
        fake.kill()
        assert http.get("/health").status_code == 503
        assert http.get("/health").json()["status"] == "no_scheduler"
        assert_error(post(http, "/v1/completions", prompt="x"), 503, contains="no scheduler")
        events, r = streamed.result(), answered.result()
    # failed (not hung until the client's timeout), and not before the grace ran out
    assert time.monotonic() - killed_at >= GRACE_S
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
            probe = redis.Redis.from_url(url)
            queued = probe.xlen(REQUESTS)
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(post, client, "/v1/completions", prompt="waits")
                wait_for(lambda: probe.xlen(REQUESTS) > queued, 30, "the request in the requests stream")
                probe.close()
                proc.terminate()
                proc.wait(5)
                for r in (client.get("/health"), post(client, "/v1/completions", prompt="x")):
                    assert assert_error(r, 503, contains="Redis")["type"] == "service_unavailable"
                assert_error(in_flight.result(), 503, contains="lost Redis")  # after GRACE_S
            proc = start_redis()
            sched = FakeScheduler(url)
            wait_for(lambda: client.get("/health").status_code == 200, 30, "the gateway healthy again")
            assert_works(client)  # the router reads responses again
    finally:
        if sched is not None:
            sched.close()
        served.close()
        proc.terminate()
        proc.wait(5)


def test_client_gone_while_uploading_is_an_abort(http, server, caplog):
    gone = f'fuseserve_http_requests_total{{model_name="{MODEL}",status="499"}}'
    in_flight = f'fuseserve_num_requests_in_flight{{model_name="{MODEL}"}}'
    aborts, errors, busy = metric(http, gone), server_errors(http), metric(http, in_flight)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO, logger="fuseserve"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + b'{"model": "' + MODEL.encode())
            wait_for(
                lambda: metric(http, in_flight) > busy, 30, "the request in the gateway, its body unread"
            )
        wait_for(lambda: metric(http, gone) != aborts, 30, "the 499 counted")
    assert metric(http, gone) == aborts + 1
    assert server_errors(http) == errors
    mine = [r for r in caplog.records if r.name.startswith("fuseserve")]
    assert len(mine) <= 1 and all(r.levelno < logging.WARNING and not r.exc_info for r in mine), mine
    assert_works(http)
