"""OpenAI error JSON for every failure the gateway answers, and the app's exception handlers.

Every error body is ``{"error": {"message", "type", "param", "code"}}``. Bad input is a 4xx, never a
500: pydantic validation errors, undecodable JSON, typed :class:`FuseServeError` s (with their
``http_status``), Starlette's 404/405. A Redis that cannot be reached (down, or no free pooled
connection within the pool timeout) is a 503, and a last-resort handler still answers OpenAI JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fuseserve.errors import ContextLengthExceededError, FuseServeError, InvalidRequestError, QueueFullError

log = logging.getLogger(__name__)


class ErrorJSON(JSONResponse):
    """An error body rendered as ASCII JSON (non-ASCII characters escaped): a lone surrogate echoed
    from the request (a model name, a field name) cannot fail its encoding and turn a 4xx into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ModelNotFoundError(InvalidRequestError):
    """The request's ``model`` is not the model this gateway serves."""

    http_status = 404

    def __init__(self, model: str, served: str):
        super().__init__(f"the model '{model}' does not exist; this server serves '{served}'", param="model")


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the gateway accepts (``RequestLimits.max_body_bytes``)."""

    http_status = 413

    def __init__(self, size: int | None, limit: int):
        got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        super().__init__(f"request body too large: {got}; the limit --max-body-bytes is {limit} bytes")


class SchedulerRejectedError(FuseServeError):
    """The scheduler answered a sequence with an error event (status and type taken from it)."""

    def __init__(self, message: str, status: int = 500, error_type: str = "server_error"):
        super().__init__(message)
        self.http_status = status
        self.error_type = error_type


class SchedulerUnavailableError(FuseServeError):
    """No live scheduler: its heartbeat key (``SCHEDULER_HEARTBEAT``) is missing from Redis."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str = "no scheduler is running: its heartbeat key is missing from Redis"):
        super().__init__(message)


class RedisUnavailableError(FuseServeError):
    """Redis did not answer (down, timed out, or no pooled connection came free in time)."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, cause: Exception):
        super().__init__(f"the gateway cannot reach Redis: {type(cause).__name__}: {cause}")


REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""Redis failures answered with 503 (``MaxConnectionsError`` is a ``ConnectionError``)."""


STATUS_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}
STATUS_TYPES |= {405: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object ``{"error": {...}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_for(exc: FuseServeError) -> dict:
    """Error body of a typed fuseserve error."""
    code = None
    if isinstance(exc, ContextLengthExceededError):
        code = "context_length_exceeded"
    elif isinstance(exc, ModelNotFoundError):
        code = "model_not_found"
    return error_body(str(exc), exc.error_type, getattr(exc, "param", None), code)


#: seconds a client is told to wait (``Retry-After``) after a 503: no worker or no scheduler now
UNAVAILABLE_RETRY_AFTER_S = 5


def error_response(exc: FuseServeError) -> JSONResponse:
    """The HTTP answer to a typed error (``Retry-After`` for a full queue, and for a 503: no worker or
    scheduler is available now, ``UNAVAILABLE_RETRY_AFTER_S``)."""
    headers = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif exc.http_status == 503:
        headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER_S)
    return ErrorJSON(error_for(exc), status_code=exc.http_status, headers=headers)


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidRequestError:
    """A 400 naming the first offending field of a pydantic validation failure."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return InvalidRequestError(f"unsupported field '{where}'", param=param)
    if param == "prompt" and len(loc) > 1:  # a union: name the accepted shapes, not pydantic's branches
        return InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            param=param,
        )
    if first.get("type") == "missing":
        return InvalidRequestError(f"missing required field '{where}'", param=param)
    return InvalidRequestError(f"invalid value for '{where}': {first.get('msg')}", param=param)


def install_handlers(app: FastAPI, on_error: Callable[[int], None] = lambda _status: None) -> None:
    """Register the exception handlers; ``on_error(status)`` is called for every error answered
    (the gateway's statuses are counted by ``gateway_metrics.MetricsMiddleware`` instead)."""

    @app.exception_handler(FuseServeError)
    async def _typed(request: Request, exc: FuseServeError) -> JSONResponse:
        on_error(exc.http_status)
        if exc.http_status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc)
        return error_response(exc)

    async def _redis(request: Request, exc: Exception) -> JSONResponse:
        on_error(503)
        log.warning(
            "%s %s: Redis unavailable: %s: %s", request.method, request.url.path, type(exc).__name__, exc
        )
        return error_response(RedisUnavailableError(exc))

    for cls in REDIS_ERRORS:
        app.add_exception_handler(cls, _redis)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error(400)
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_error(exc.status_code)
        kind = STATUS_TYPES.get(
            exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error"
        )
        return ErrorJSON(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        on_error(500)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ErrorJSON(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
