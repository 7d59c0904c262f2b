"""Gateway serving options and utilities on a fake scheduler: several served names, ``/v1/models/{id}``,
``/tokenize``, ``/detokenize``, ``--max-model-len`` (and vLLM's default ``max_tokens``: the rest of
the context), ``--chat-template FILE``."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import ServedApp

from fuseserve.gateway.app import GatewaySettings, create_app

NAMES = ["first-name", "second/name"]
CONTEXT = 64
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def http(redis_server, smollm2_source, fake, tmp_path_factory):  # noqa: F811
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    settings = GatewaySettings(
        redis_server.url,
        source=smollm2_source,
        served_model_name=NAMES,
        max_model_len=CONTEXT,
        chat_template=str(template),
        admission_cache_s=0,
    )
    served = ServedApp(create_app(settings))
    with httpx.Client(base_url=served.url, timeout=20) as client:
        yield client
    served.close()


@pytest.fixture(scope="module")
def tok(smollm2_source):
    return smollm2_source.load_tokenizer()


def test_models_by_name(http):
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == NAMES and all(m["max_model_len"] == CONTEXT for m in listed)
    assert http.get(f"/v1/models/{NAMES[1]}").json()["id"] == NAMES[1]
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    body = http.post("/v1/completions", json={"model": NAMES[1], "prompt": "hi", "max_tokens": 2}).json()
    assert body["model"] == NAMES[1]


def test_tokenize_detokenize_and_chat_template_file(http, tok):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r == {
        "count": len(tok("Hello world")["input_ids"]),
        "max_model_len": CONTEXT,
        "tokens": tok("Hello world")["input_ids"],
    }
    r = http.post(
        "/tokenize", json={"model": NAMES[0], "messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert r["tokens"] == tok("<user>Hi\n<assistant>", add_special_tokens=False)["input_ids"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "<user>Hi\n<assistant>"
    }
    for path, body in (
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {"messages": [{"role": "user"}]}),  # the chat endpoint's content rules
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": "abc"}),
    ):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        if path == "/detokenize":
            assert r.json()["error"]["param"] == "tokens", r.text  # the field sent, not "prompt"
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_max_model_len_and_default_max_tokens(http, tok):
    ids = tok("one two three four five")["input_ids"]
    body = {"model": NAMES[0], "prompt": ids, "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == CONTEXT - len(ids)  # vLLM's default: the rest of the context
    r = http.post("/v1/completions", json={**body, "max_tokens": CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_echo_returns_the_prompt_first(http, tok):
    body = {"model": NAMES[0], "prompt": "Hello world", "max_tokens": 2, "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith("Hello world") and len(choice["text"]) > len("Hello world")
    r = http.post("/v1/completions", json={**body, "max_tokens": 0, "logprobs": 0}).json()
    assert r["choices"][0]["text"] == "Hello world" and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == "Hello world" and lp["token_logprobs"][0] is None
