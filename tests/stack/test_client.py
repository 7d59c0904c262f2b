"""``fuseserve.Client`` against a gateway served by uvicorn, a real Redis and a fake scheduler.

The fake scheduler (``tests/gateway_harness.py``) echoes the prompt ids, then a hidden EOS.
"""

from __future__ import annotations

import pytest
from gateway_harness import EOS, FakeScheduler, ServedApp

import fuseserve
from fuseserve.errors import (
    FuseServeError,
    InvalidParameterError,
    InvalidRequestError,
    NoWorkerError,
    QueueFullError,
)
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.redis_launcher import free_port, launch_redis

MAX_QUEUE = 4


@pytest.fixture(scope="module")
def fake():
    with launch_redis() as server:
        sched = FakeScheduler(server.url)
        yield sched
        sched.close()


@pytest.fixture(autouse=True)
def _reset_fake(fake):
    yield
    fake.error_next = None
    if fake.dead:
        fake.revive()
    fake.add_worker()
    fake.set_waiting(0)


@pytest.fixture(scope="module")
def client(fake, smollm2_source):
    settings = GatewaySettings(fake.url, source=smollm2_source, max_queue=MAX_QUEUE, admission_cache_s=0)
    served = ServedApp(create_app(settings))
    with fuseserve.Client(served.url, timeout=20) as c:
        yield c
    served.close()


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def test_generate_single_batch_and_token_ids(client, tok):
    prompt = "Tell me about the ocean."
    ids = tok(prompt)["input_ids"]
    (r,) = client.generate(prompt, max_new_tokens=64)
    assert isinstance(r, fuseserve.Response)
    assert r.text == prompt and r.finish_reason == "stop"
    assert r.token_ids == ids + [EOS] and r.generated_tokens == len(ids) + 1
    assert r.prompt_tokens == len(ids)
    out = client.generate(["first one", ids], max_new_tokens=64)  # mixed: one request each
    assert [o.text for o in out] == ["first one", prompt]
    out = client.generate(["a b c d", "d e"], max_new_tokens=3)
    assert [o.text for o in out] == ["a b c", "d e"] and [o.finish_reason for o in out] == ["length", "stop"]
    with pytest.raises(InvalidRequestError, match="empty"):  # as the pipeline: [] is an empty prompt
        client.generate([])


def test_defaults_match_the_pipeline(client, fake):
    """No max_new_tokens: the pipeline's default (SamplingParams: 16), not the whole context."""
    r = client.generate(" word" * 40)[0]
    assert r.finish_reason == "length" and r.generated_tokens == 16
    sent = fake.requests[-1].params
    assert sent == fuseserve.SamplingParams().to_dict() | {"max_new_tokens": 16}


def test_sampling_keywords_are_sent(client, fake):
    client.generate(
        "x", max_new_tokens=5, min_new_tokens=2, temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, seed=3,
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, stop="zz", stop_token_ids=[7],
        ignore_eos=False, logprobs=2,
    )  # fmt: skip
    p = fake.requests[-1].params
    assert (p["max_new_tokens"], p["min_new_tokens"], p["top_k"], p["seed"], p["logprobs"]) == (5, 2, 4, 3, 2)
    assert p["stop"] == ["zz"] and p["stop_token_ids"] == [7] and p["temperature"] == 0.5


def test_logprobs(client, tok):
    ids = tok("log probs")["input_ids"]
    r = client.generate(ids, max_new_tokens=10, logprobs=2)[0]
    assert r.logprobs == [-0.25] * len(r.token_ids)
    assert [[t.token_id for t in alts] for alts in r.top_logprobs][0] == [ids[0], ids[0] + 1]


def test_stream_joins_to_generate(client):
    prompt = "A streamed sentence, with ünïcödé 🎉."
    pieces = list(client.stream(prompt, max_new_tokens=64))
    assert len(pieces) > 1
    assert "".join(pieces) == client.generate(prompt, max_new_tokens=64)[0].text == prompt
    assert "".join(client.stream(prompt, max_new_tokens=64, stop=" with")) == "A streamed sentence,"


def test_chat(client, tok):
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    r = client.chat(messages, max_new_tokens=200)
    assert r.text == tok.decode(ids, skip_special_tokens=True)
    assert r.prompt_tokens == len(ids) and r.token_ids == ids + [EOS]


def test_errors_are_typed(client, fake):
    with pytest.raises(InvalidParameterError):  # validated locally, like the pipeline
        client.generate("x", temperature=-1)
    with pytest.raises(InvalidRequestError, match="frobnicate"):
        client.generate("x", frobnicate=1)
    with pytest.raises(InvalidRequestError, match="8192") as info:
        client.generate([1] * 8190, max_new_tokens=16)
    assert info.value.http_status == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="empty"):
        client.generate("")
    fake.set_waiting(MAX_QUEUE)
    with pytest.raises(QueueFullError) as info:
        client.generate("x")
    assert info.value.retry_after >= 1
    fake.set_waiting(0)
    fake.remove_worker()
    with pytest.raises(NoWorkerError):
        list(client.stream("x"))
    fake.add_worker()
    fake.error_next = {"message": "worker lost", "type": "server_error", "status": 503}
    with pytest.raises(NoWorkerError, match="worker lost"):
        list(client.stream("x"))
    assert client.generate("still fine")[0].text == "still fine"


def test_no_scheduler_is_no_worker_error(client, fake):
    assert client.health()["status"] == "ok"
    fake.kill()
    with pytest.raises(NoWorkerError, match="no_scheduler"):
        client.health()
    with pytest.raises(NoWorkerError, match="no scheduler"):
        client.generate("x")
    with pytest.raises(NoWorkerError, match="no scheduler"):
        list(client.stream("x"))
    fake.revive()
    assert client.generate("back again")[0].text == "back again"


def test_unknown_model_and_unreachable(client):
    other = fuseserve.Client(client.url, model="gpt-4")
    with pytest.raises(InvalidRequestError, match="gpt-4") as info:
        other.generate("x")
    assert info.value.http_status == 404
    other.close()
    with (
        pytest.raises(FuseServeError, match="cannot reach"),
        fuseserve.Client(f"http://127.0.0.1:{free_port()}") as c,
    ):
        c.generate("x")
