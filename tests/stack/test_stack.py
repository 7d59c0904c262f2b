"""The persistent stack end to end: real redis-server, scheduler, 2 gRPC workers, gateway, on SmolLM2.

Started by the same code as ``fuseserve serve`` (``fuseserve.launcher.start_stack``), driven by the
official ``openai`` client and raw HTTP.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import httpx
import pytest
import redis
from stack_harness import MODEL, openai_client, wait_for

from fuseserve import messages

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack[1])


def redis_client(stack) -> redis.Redis:
    return redis.Redis.from_url(stack[0].redis.url, decode_responses=True)


def test_openai_chat_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text


def test_stream_equals_non_stream_seeded(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full and full


def test_concurrent_requests_use_both_workers_and_match_pipeline(stack, client, pipe):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]

    def ask(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text

    stats_redis = redis_client(stack)
    before = messages.read_scheduler_stats(stats_redis)["workers"]
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(ask, prompts))
    expected = [r.text for r in pipe(prompts, max_new_tokens=12, temperature=0.0)]
    assert got == expected

    def served() -> dict[str, int] | None:
        """Admissions per worker since ``before``, once the stats (written each second) count all 32."""
        after = messages.read_scheduler_stats(stats_redis).get("workers", {})
        n = {w: after[w]["admitted"] - before.get(w, {}).get("admitted", 0) for w in after}
        return n if sum(n.values()) >= 32 else None

    counts = wait_for(served, 60, "32 admissions in the scheduler's stats")
    assert len(counts) == 2 and all(n > 0 for n in counts.values()), counts


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (json.dumps({"model": MODEL, "prompt": 12.5}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "hi " * 9000, "max_tokens": 16}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -3}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "hi", "frobnicate": 1}).encode(), 400),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
        (json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}).encode(), 400),
    ],
)
def test_bad_input_is_a_4xx_and_the_next_request_works(stack, client, body, status):
    r = httpx.post(
        f"{stack[1]}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = client.completions.create(model=MODEL, prompt="2+2=", max_tokens=2, temperature=0)
    assert ok.choices[0].text


def test_context_error_has_the_numbers(stack):
    r = httpx.post(
        f"{stack[1]}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100000}, timeout=60
    )
    assert r.status_code == 400
    assert "8192" in r.json()["error"]["message"]


def worker_health(stack) -> list:
    from fuseserve.proto import worker_pb2 as pb
    from fuseserve.proto import worker_pb2_grpc as pb_grpc

    r = redis_client(stack)
    out = []
    for key in r.scan_iter(match=f"{messages.WORKER_PREFIX}*"):
        rec = messages.WorkerRecord.decode(r.get(key))
        with grpc.insecure_channel(rec.address) as ch:
            out.append((rec, pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10)))
    return out


def test_disconnect_mid_stream_frees_the_sequence(stack):
    body = {
        "model": MODEL,
        "prompt": "Write a very long essay about the sea.",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{stack[1]}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= 3:
                    break
        wait_for(  # the sequence is on a worker while it streams
            lambda: any(h.num_running_seqs > 0 for _, h in worker_health(stack)),
            60,
            "the streaming sequence on a worker",
        )
    wait_for(
        lambda: all(
            h.num_running_seqs == 0 and h.num_free_blocks == rec.num_blocks for rec, h in worker_health(stack)
        ),
        60,
        "the sequence freed on its worker after the disconnect",
    )
