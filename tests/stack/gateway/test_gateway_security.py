"""API keys and per-request limits at the gateway, against a real Redis and a fake scheduler.

The gateway runs under uvicorn at its most verbose (``trace``: ASGI messages, access log), every log
record of the process is captured, and the last test checks that no key appears in any of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import httpx
import pytest
from gateway_harness import ServedApp
from gateway_http import MODEL, assert_error

from fuseserve.config import API_KEY_ENV, RequestLimits
from fuseserve.gateway.app import GatewaySettings, create_app, settings_from_args
from fuseserve.gateway.auth import ApiKeyFileError, ApiKeys, read_key_file

KEY = "sk-test-4f1c2d9e8b7a"
FILE_KEY = "sk-from-file-0a9b8c7d"  # stored in the key file as its SHA-256 only
LIMITS = RequestLimits(
    max_body_bytes=8192,
    max_prompt_tokens=40,
    max_n=2,
    max_stop=2,
    max_stop_chars=8,
    max_output_tokens=6,
    max_logprobs=2,
    max_schema_bytes=64,
    max_concurrent_per_key=2,
)


CLIENT_LOGGERS = ("httpx", "httpcore")
"""The test's own HTTP client: it sends the keys, its logs are not the server's."""


class _Records(logging.Handler):
    """Every server-side log record of the process, as its final message text."""

    def __init__(self):
        super().__init__(level=1)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(CLIENT_LOGGERS):
            return
        self.lines.append(
            record.getMessage() + (self.formatException(record.exc_info) if record.exc_info else "")
        )

    def formatException(self, exc_info) -> str:  # noqa: N802 (logging's name)
        return logging.Formatter().formatException(exc_info)


@pytest.fixture(scope="module")
def records():
    handler = _Records()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(1)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.fixture(scope="module")
def server(redis_server, smollm2_source, fake, records, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# team B\n\nsha256:{hashlib.sha256(FILE_KEY.encode()).hexdigest()}\n")
    settings = GatewaySettings(
        redis_server.url,
        source=smollm2_source,
        limits=LIMITS,
        api_keys=ApiKeys.load([KEY], key_file=key_file, env=False),
        protect_metrics=True,
        admission_cache_s=0,
        disconnect_poll_s=0.1,
    )
    # log_config=None: uvicorn's loggers propagate to the root logger (captured); trace: the most it logs
    served = ServedApp(create_app(settings), log_level="trace", log_config=None, access_log=True)
    yield served
    served.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=20, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _completion(**body) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, **body}


# --------------------------------------------------------------------------- API keys
def test_missing_wrong_and_right_key(server, http):
    with httpx.Client(base_url=server.url, timeout=20) as anon:
        r = anon.post("/v1/completions", json=_completion())
        err = assert_error(r, 401, contains="didn't provide an API key")
        assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
        assert_error(anon.get("/v1/models"), 401)
        r = anon.post("/v1/completions", json=_completion(), headers={"Authorization": "Bearer sk-wrong"})
        assert assert_error(r, 401)["code"] == "invalid_api_key"
        r = anon.post("/v1/completions", json=_completion(), headers={"Authorization": f"Basic {KEY}"})
        assert_error(r, 401)
        assert anon.get("/health").status_code == 200  # probes need no key
        assert_error(anon.get("/metrics"), 401)  # protect_metrics
        r = anon.post("/v1/completions", json=_completion(), headers={"Authorization": f"Bearer {FILE_KEY}"})
        assert r.status_code == 200, r.text  # a key stored hashed in the file
    r = http.post("/v1/completions", json=_completion())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello there"
    assert http.get("/metrics").status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_key_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("plain-key\nsha256:" + "ab" * 32 + "\n")
    assert len(read_key_file(path)) == 2
    keys = ApiKeys.load(key_file=path, env=False)
    assert keys.check("plain-key") and not keys.check("plain-keyX") and not keys.check(None)
    for bad in ("sha256:xyz\n", "# only a comment\n"):
        path.write_text(bad)
        with pytest.raises(ApiKeyFileError):
            read_key_file(path)
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        read_key_file(tmp_path / "missing")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert ApiKeys.load() is None  # no key anywhere: auth off
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ApiKeys.load().check("from-env")


def test_gateway_flags_build_the_settings():
    from fuseserve.cli import build_parser

    args = build_parser().parse_args(
        ["gateway", "--redis-url", "redis://x:1", "--api-key", "k", "--max-n", "3", "--protect-metrics"]
    )
    settings = settings_from_args(args)
    assert settings.api_keys.check("k") and settings.protect_metrics
    assert settings.limits == RequestLimits(max_n=3)


# --------------------------------------------------------------------------- limits
LIMIT_CASES = {
    "n": (_completion(n=3), 400, "n", "--max-n=2"),
    "max_tokens": (_completion(max_tokens=7), 400, "max_tokens", "--max-output-tokens=6"),
    "logprobs": (_completion(logprobs=3), 400, "logprobs", "--max-logprobs=2"),
    "stop count": (_completion(stop=["a", "b", "c"]), 400, "stop", "--max-stop=2"),
    "stop length": (_completion(stop=["ok", "x" * 9]), 400, "stop", "--max-stop-chars=8"),
    "stop string length": (_completion(stop="y" * 9), 400, "stop", "--max-stop-chars=8"),
    "prompt tokens": (_completion(prompt="one two three " * 20), 400, "prompt", "--max-prompt-tokens=40"),
    "body": (_completion(prompt="z" * 9000), 413, None, "--max-body-bytes"),
    "schema": (
        _completion(response_format={"type": "json_schema", "json_schema": {"schema": {"x": "y" * 64}}}),
        400,
        "response_format",
        "--max-schema-bytes=64",
    ),
}


@pytest.mark.parametrize("case", LIMIT_CASES, ids=list(LIMIT_CASES))
def test_each_limit_is_enforced_with_its_status(http, case):
    body, status, param, names = LIMIT_CASES[case]
    assert_error(http.post("/v1/completions", json=body), status, param=param, contains=names)


def test_chat_limits_and_values_at_the_limits_pass(http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3})
    assert_error(r, 400, param="top_logprobs", contains="--max-logprobs=2")
    r = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 9})
    assert_error(r, 400, param="max_completion_tokens", contains="--max-output-tokens=6")
    long = {**chat, "messages": [{"role": "user", "content": "hi " * 40}]}
    assert_error(http.post("/v1/chat/completions", json=long), 400, "messages", "--max-prompt-tokens=40")
    r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json=_completion(stop=["ab", "x" * 8], logprobs=2, max_tokens=6))
    assert r.status_code == 200, r.text


def test_limits_with_zero_logprobs():
    from fuseserve.gateway.limits import Limiter, LimitExceededError

    limiter = Limiter(RequestLimits(max_logprobs=0))
    limiter.check_body({"logprobs": True, "messages": []})  # chat: the chosen token only
    limiter.check_body({"logprobs": 0, "prompt": "x"})
    with pytest.raises(LimitExceededError, match="--max-logprobs=0"):
        limiter.check_body({"logprobs": 1, "prompt": "x"})
    limiter.check_body({"n": "many"})  # a type error: the request model reports it, not the limits


def test_max_n_is_the_only_upper_bound_on_n():
    """``--max-n`` raised above its default of 16 lets a larger ``n`` through; ``n`` < 1 stays a 400."""
    from fuseserve.errors import InvalidParameterError
    from fuseserve.frontend.openai_params import check_n
    from fuseserve.gateway.limits import Limiter, LimitExceededError

    Limiter(RequestLimits(max_n=32)).check_body({"n": 20, "prompt": "x"})
    check_n(20)
    with pytest.raises(LimitExceededError, match="--max-n=32"):
        Limiter(RequestLimits(max_n=32)).check_body({"n": 33, "prompt": "x"})
    with pytest.raises(InvalidParameterError):
        check_n(0)


def test_max_output_tokens_is_the_default(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7, 8] * 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LIMITS.max_output_tokens


async def _concurrent(url: str, keys: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = _completion(prompt=[5, 6, 7], max_tokens=6, ignore_eos=True)
        return await asyncio.gather(
            *(
                client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {k}"})
                for k in keys
            )
        )


def test_concurrent_requests_per_key_get_429_with_retry_after(server, http, fake):
    fake.token_delay = 0.2  # each request holds its slot about 1.2 s
    responses = asyncio.run(_concurrent(server.url, [KEY] * 5 + [FILE_KEY] * 2))
    by_key = {KEY: [r.status_code for r in responses[:5]], FILE_KEY: [r.status_code for r in responses[5:]]}
    assert sorted(by_key[KEY]) == [200, 200, 429, 429, 429], by_key
    assert by_key[FILE_KEY] == [200, 200], by_key  # another key has its own allowance
    refused = next(r for r in responses if r.status_code == 429)
    err = assert_error(refused, 429, contains="--max-concurrent-per-key")
    assert err["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
    fake.token_delay = 0.0
    assert http.post("/v1/completions", json=_completion()).status_code == 200  # slots were released


def test_fuseserve_client_sends_its_key(server, monkeypatch):
    import fuseserve
    from fuseserve.errors import InvalidRequestError

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with fuseserve.Client(server.url, timeout=20, api_key=KEY) as client:
        assert client.generate("Hello there", max_new_tokens=2)[0].text == "Hello there"
    with fuseserve.Client(server.url, timeout=20, model=MODEL) as client:
        with pytest.raises(InvalidRequestError) as refused:
            client.generate("Hello there", max_new_tokens=2)
        assert refused.value.http_status == 401
    monkeypatch.setenv(API_KEY_ENV, FILE_KEY)
    with fuseserve.Client(server.url, timeout=20) as client:
        assert client.models() == [MODEL]


def test_no_key_in_any_log_line(server, http, records):
    with httpx.Client(base_url=server.url, timeout=20) as anon:
        anon.post("/v1/completions", json=_completion(), headers={"Authorization": f"Bearer {KEY}x"})
        anon.post("/v1/completions", json=_completion(), headers={"Authorization": f"Bearer {FILE_KEY}"})
    http.post("/v1/completions", json=_completion(n=9))  # an error path too
    http.post("/v1/completions", json=_completion(), headers={"Authorization": f"Bearer {KEY}"})
    lines = records.lines
    assert any("POST /v1/completions" in line for line in lines), "the access log was not captured"
    assert any("401" in line for line in lines)
    for secret in (KEY, FILE_KEY, hashlib.sha256(FILE_KEY.encode()).hexdigest()):
        leaked = [line for line in lines if secret in line]
        assert not leaked, leaked[:3]
