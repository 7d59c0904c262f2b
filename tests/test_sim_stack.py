"""A simulated stack (``fuseserve.serve(..., simulate=PRESET)``): real Redis, scheduler and gateway with
the SmolLM2 tokenizer, two simulated workers (slowdowns 1 and 3), driven by the ``openai`` client; the
scheduler runs with latency targets (passes sized by ``slo_budget``)."""

from __future__ import annotations

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
        MODEL,
        workers=2,
        port=free_port(),
        simulate="a100-llama2-7b",
        simulate_slowdown="1,3",
        target_itl=0.25,
        target_prefill_rate=512,
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


def test_scheduler_gets_the_latency_targets(server):
    """``fuseserve serve --target-itl --target-prefill-rate`` hands them to the scheduler (the other
    tests here run with them: a simulated worker has no start-up profile, so its passes are sized
    once 8 are measured)."""
    scheduler = next(argv for name, argv in server.stack.argv.items() if name.startswith("scheduler"))
    assert scheduler[-4:] == ["--target-itl", "0.25", "--target-prefill-rate", "512"]
