"""The gateway's LoRA surface on a fake scheduler: a request's ``model`` names an adapter of
``--lora-modules`` and its ``RequestMessage`` carries it (``lora``), the base model's names carry none,
an unknown name is a 404; ``/v1/models`` lists the adapters with ``parent``. The gateway reads only the
adapters' names (the paths here do not exist)."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_harness import ServedApp

from fuseserve.errors import InvalidParameterError
from fuseserve.gateway.app import GatewaySettings, create_app
from fuseserve.gateway.served_models import ServedModels
from fuseserve.messages import RequestMessage

BASE = "base-model"


@pytest.fixture(scope="module")
def http(redis_server, smollm2_source, fake):
    settings = GatewaySettings(
        redis_server.url,
        source=smollm2_source,
        served_model_name=BASE,
        lora_modules=["sql=/nowhere/sql", "tone=/nowhere/tone"],
        admission_cache_s=0,
    )
    served = ServedApp(create_app(settings))
    with httpx.Client(base_url=served.url, timeout=20) as client:
        yield client
    served.close()


@pytest.mark.parametrize(
    ("model", "lora"), [("sql", "sql"), ("tone", "tone"), (BASE, None)], ids=["sql", "tone", "base"]
)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_model_name_selects_the_adapter(http, fake, model, lora, chat, stream):
    body = {"model": model, "max_tokens": 3, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    r = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["model"] == model
    assert fake.requests[-1].lora == lora


def test_an_unknown_model_is_a_404(http, fake):
    before = len(fake.requests)
    r = http.post("/v1/completions", json={"model": "nope", "prompt": [5], "max_tokens": 1})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "sql" in error["message"] and "tone" in error["message"]
    assert len(fake.requests) == before


def test_models_lists_the_adapters_with_their_parent(http):
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE), ("tone", BASE)]
    assert http.get("/v1/models/sql").json()["parent"] == BASE
    assert http.get("/v1/models/nope").status_code == 404
    assert http.post("/tokenize", json={"model": "tone", "prompt": "hi"}).status_code == 200


def test_an_adapter_named_like_the_model_is_refused():
    with pytest.raises(InvalidParameterError):
        ServedModels([BASE], {BASE: "/x"})
    with pytest.raises(InvalidParameterError):
        ServedModels([BASE], ["no-path"])


def test_a_base_request_message_has_no_lora_field():
    """A request of the base model reads the same as before adapters (a scheduler of an older
    release decodes it); one with an adapter carries it."""
    base = RequestMessage(1, "r", "g", [1, 2], {}).encode()
    assert "lora" not in json.loads(base["data"])
    assert RequestMessage.decode(base).lora is None
    assert RequestMessage.decode(RequestMessage(1, "r", "g", [1], {}, lora="sql").encode()).lora == "sql"
