"""HTTP helpers and settings shared by the gateway tests (``tests/stack/gateway/``); the fixtures
(Redis, the fake scheduler, the served gateway) are in that folder's ``conftest.py``."""

from __future__ import annotations

import json

MODEL = "smollm2-135m-instruct"
MAX_BODY = 64 * 1024
MAX_QUEUE = 8
GRACE_S = 1.0  # seconds without a scheduler heartbeat before requests in flight fail


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
