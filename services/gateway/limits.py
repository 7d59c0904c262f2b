"""What one request may cost: the gateway's side of ``fuseserve.config.RequestLimits``.

Each limit is refused with a 4xx whose message names the limit's flag (``--max-n`` ...):

- body size: 413, while reading the body (``Gateway.read_json``);
- ``n``, ``max_tokens`` / ``max_completion_tokens``, ``logprobs`` / ``top_logprobs``, the number and
  length of stop strings: 400, by a pydantic model built from the configured limits
  (:func:`limits_model`) run on the body before the request model (which reports type errors);
- JSON size of schema-carrying fields (``response_format``, ``tools``, ``guided_json``, ...): 400;
- prompt tokens: 400, once the prompts are tokenized (:meth:`Limiter.check_prompts`);
- requests in flight per API key (per client address without keys): 429 with ``Retry-After``, by
  :class:`ConcurrencyLimitMiddleware`, held until the response (a stream included) has ended.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fuseserve.config import RequestLimits
from fuseserve.errors import InvalidRequestError
from fuseserve.gateway.auth import ApiKeyMiddleware, ApiKeys, bearer_token, digest
from fuseserve.gateway.http_errors import error_body

log = logging.getLogger(__name__)

SCHEMA_FIELDS = (
    "response_format",
    "tools",
    "guided_json",
    "guided_grammar",
    "guided_regex",
    "structured_outputs",
)
"""Body fields whose JSON size ``max_schema_bytes`` bounds (whether or not the endpoint accepts them)."""

FIELD_LIMITS = {
    "n": "max_n",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "logprobs": "max_logprobs",
    "top_logprobs": "max_logprobs",
    "stop": "max_stop",
}
"""Request field → the ``RequestLimits`` field bounding it (stop: count; each string: ``max_stop_chars``)."""

BOUND_ERRORS = frozenset({"less_than_equal", "too_long", "string_too_long"})
"""pydantic error types of a value past its bound (the rest are type errors)."""

RETRY_AFTER_S = 1


def flag(name: str) -> str:
    """The gateway flag of a ``RequestLimits`` field (``max_n`` → ``--max-n``)."""
    return next(f.metadata["flag"] for f in fields(RequestLimits) if f.name == name)


class LimitExceededError(InvalidRequestError):
    """A request asks for more than a configured limit; the message names the limit's flag.

    param: the request field. limit: the ``RequestLimits`` field. value: what was asked. allowed: the limit.
    """

    def __init__(self, param: str | None, limit: str, value: object, allowed: object, status: int = 400):
        super().__init__(
            f"{param or 'request'}={value} exceeds the limit {flag(limit)}={allowed} of this server",
            param=param,
        )
        self.http_status = status
        self.limit = limit


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _chat_logprobs(value: Any) -> Any:
    """Chat's ``logprobs: true`` asks for the chosen token only (its alternatives are ``top_logprobs``)."""
    return 0 if isinstance(value, bool) else value


def limits_model(limits: RequestLimits) -> type[BaseModel]:
    """A pydantic model of the bounded request fields, its bounds taken from ``limits``.

    Types are not its business (the request model checks them): unknown fields are ignored and
    values are coerced leniently (chat's ``logprobs: true`` counts as 0 alternatives).
    """

    def upto(limit: int | None) -> Any:
        return Field(default=None, le=limit) if limit is not None else None

    stop_string = Annotated[str, Field(max_length=limits.max_stop_chars)]
    return create_model(
        "RequestLimitsModel",
        __config__=ConfigDict(extra="ignore"),
        n=(int | None, upto(limits.max_n)),
        max_tokens=(int | None, upto(limits.max_output_tokens)),
        max_completion_tokens=(int | None, upto(limits.max_output_tokens)),
        logprobs=(Annotated[int | None, BeforeValidator(_chat_logprobs)], upto(limits.max_logprobs)),
        top_logprobs=(int | None, upto(limits.max_logprobs)),
        stop=(
            Annotated[list[stop_string] | None, BeforeValidator(_as_list)],
            Field(default=None, max_length=limits.max_stop),
        ),
    )


class Limiter:
    """Checks one request body and its prompts against ``limits`` (see the module docstring)."""

    def __init__(self, limits: RequestLimits):
        limits.validate()
        self.limits = limits
        self.model = limits_model(limits)

    def check_body(self, data: dict) -> None:
        """Raise ``LimitExceededError`` (400) for the first field of ``data`` past its limit."""
        for name in SCHEMA_FIELDS:
            if data.get(name) is not None:
                size = len(json.dumps(data[name], separators=(",", ":")).encode())
                if size > self.limits.max_schema_bytes:
                    limit = self.limits.max_schema_bytes
                    raise LimitExceededError(name, "max_schema_bytes", f"{size} bytes", limit)
        try:
            self.model.model_validate(data)
        except ValidationError as e:
            # type errors are the request model's to report; only bounds are ours
            bounds = [err for err in e.errors() if err["type"] in BOUND_ERRORS]
            if not bounds:
                return
            err = bounds[0]
            param = str(err["loc"][0])
            if err["type"] == "string_too_long":  # one stop string
                value = f"a string of {len(err['input'])} characters"
                raise LimitExceededError(param, "max_stop_chars", value, self.limits.max_stop_chars) from None
            limit = FIELD_LIMITS[param]
            value = f"{len(err['input'])} strings" if param == "stop" else err["input"]
            raise LimitExceededError(param, limit, value, getattr(self.limits, limit)) from None

    def check_prompts(self, prompt_lens: list[int], param: str = "prompt") -> None:
        """Raise ``LimitExceededError`` (400, ``param``: "prompt" or "messages") for a prompt longer
        than ``max_prompt_tokens`` (a chat prompt counted after its template)."""
        limit = self.limits.max_prompt_tokens
        if limit is not None and prompt_lens and max(prompt_lens) > limit:
            raise LimitExceededError(param, "max_prompt_tokens", f"{max(prompt_lens)} tokens", limit)

    def default_max_tokens(self, req: Any, room: int) -> None:
        """With ``max_output_tokens`` set, give a request that asks no ``max_tokens`` that many
        (when fewer than ``room``, the context left after its longest prompt); changes ``req``."""
        limit = self.limits.max_output_tokens
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if limit is not None and asked is None and limit < room:
            req.max_tokens = limit


class ConcurrencyLimitMiddleware:
    """ASGI middleware: at most ``max_in_flight`` generation requests (``POST /v1/...``) in flight per
    API key (its SHA-256 digest; per client address when none is sent); more get 429 with
    ``Retry-After``. A request counts until the inner app returns, i.e. until its response, streamed
    or not, has ended or its client has gone. ``on_refuse(status)`` is called for every 429."""

    def __init__(self, app: ASGIApp, max_in_flight: int, on_refuse: Callable[[int], None] | None = None):
        self.app = app
        self.max_in_flight = max_in_flight
        self.on_refuse = on_refuse
        self.in_flight: dict[str, int] = {}

    @staticmethod
    def key_of(scope: Scope) -> str:
        token = bearer_token(scope["headers"])
        if token is not None:
            return "key:" + digest(token).hex()
        client = scope.get("client")
        return "client:" + (client[0] if client else "?")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.max_in_flight <= 0
            or scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith("/v1/")
        ):
            await self.app(scope, receive, send)
            return
        key = self.key_of(scope)
        count = self.in_flight.get(key, 0)
        if count >= self.max_in_flight:
            if self.on_refuse is not None:
                self.on_refuse(429)
            message = (
                f"too many concurrent requests for this API key: {count} in flight; "
                f"the limit {flag('max_concurrent_per_key')} is {self.max_in_flight}"
            )
            body = error_body(message, "rate_limit_error", code="concurrency_limit_exceeded")
            response = JSONResponse(body, status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        self.in_flight[key] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]


def install_guards(
    app: ASGIApp,
    limits: RequestLimits,
    keys: ApiKeys | None,
    protect_metrics: bool = False,
    on_refuse: Callable[[int], None] | None = None,
) -> None:
    """Add the API-key check (outermost, when ``keys``) and the per-key concurrency limit to a
    Starlette/FastAPI ``app``; ``on_refuse(status)`` is called for each 401 / 429 they answer."""
    app.add_middleware(
        ConcurrencyLimitMiddleware, max_in_flight=limits.max_concurrent_per_key, on_refuse=on_refuse
    )
    if keys is not None:  # added last: runs first
        app.add_middleware(ApiKeyMiddleware, keys=keys, protect_metrics=protect_metrics, on_refuse=on_refuse)
