"""A simulated stack (``fuseserve.serve(..., simulate=PRESET)``): real Redis, scheduler and gateway with
the SmolLM2 tokenizer, two simulated workers (slowdowns 1 and 3), driven by the ``openai`` client."""

from __future__ import annotations

import json

import pytest
import redis
from stack_harness import MODEL, openai_client

from fuseserve import messages
from fuseserve.redis_launcher import free_port

PROMPT = "Simulated workers answer with deterministic tokens:"


@pytest.fixture(scope="module")
def server(smollm2_source):
    import fuseserve

    with fuseserve.serve(
        MODEL, workers=2, port=free_port(), simulate="a100-llama2-7b", simulate_slowdown="1,3"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_completion_max_tokens_usage_and_determinism(client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 9
    assert a.choices[0].text.strip()
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    assert b.choices[0].text == a.choices[0].text  # tokens are a function of the prompt and position
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == a.choices[0].text


def test_stop_string_and_chat(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content


def test_workers_register_simulated_with_metrics_ports(server):
    r = redis.Redis.from_url(server.stack.redis.url, decode_responses=True)
    recs = [messages.WorkerRecord.decode(r.get(k)) for k in r.scan_iter(f"{messages.WORKER_PREFIX}*")]
    assert sorted(rec.worker_id for rec in recs) == ["worker-0", "worker-1"]
    assert all(rec.metrics_port and rec.eos_token_ids == [] for rec in recs)
    argv = server.stack.argv
    assert argv["worker-0"][-2:] == ["--simulate-slowdown", "1.0"]
    assert argv["worker-1"][-2:] == ["--simulate-slowdown", "3.0"]


def test_top_once_reads_every_service(server, client, capsys):
    from fuseserve.cli import main

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0)
    argv = ["top", "--url", server.url, "--redis-url", server.stack.redis.url, "--once", "--json"]
    assert main([*argv, "--interval", "0.2"]) == 0
    frame = json.loads(capsys.readouterr().out)
    assert frame["errors"] == [] and frame["scheduler"]["schedulers"] == 1
    assert frame["scheduler"]["workers"] == 2 and frame["gateway"]["in_flight"] == 0
    assert sorted(w["worker"] for w in frame["workers"]) == ["worker-0", "worker-1"]
    assert all(w["kv_usage"] == 0 and w["blocks_total"] > 0 for w in frame["workers"])
    assert main(["top", "--url", server.url, "--once", "--interval", "0"]) == 0  # the rich table
    assert "in flight" in capsys.readouterr().out
