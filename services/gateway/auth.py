"""API keys at the gateway: ``Authorization: Bearer <key>`` checked before anything else runs.

Keys come from ``--api-key KEY`` (repeatable), ``$FUSESERVE_API_KEY``, or ``--api-key-file PATH``
(one key per line; ``#`` comments and blank lines skipped; a line ``sha256:<64 hex digits>`` is a key
stored as its SHA-256 digest, e.g. ``printf %s "$KEY" | sha256sum``). Only digests are kept in
memory. A presented key is hashed and compared with every stored digest by ``hmac.compare_digest``
(constant time, no early exit), so timing reveals neither a key nor which one matched.

Without keys the gateway is open (the local ``fuseserve serve``). With keys, every path needs one
except ``/health`` (probes) and, unless ``protect_metrics``, ``/metrics`` (Prometheus). A missing or
wrong key is a 401 with OpenAI's error JSON (``code`` ``invalid_api_key`` for a wrong one) and a
``WWW-Authenticate: Bearer`` header. No key, header or digest is ever logged: refusals log the
client address only, and uvicorn's access log carries method, path and status, never headers.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fuseserve.config import API_KEY_ENV
from fuseserve.errors import FuseServeError
from fuseserve.gateway.http_errors import error_body

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a key."""

_SHA256_PREFIX = "sha256:"


class ApiKeyFileError(FuseServeError):
    """``--api-key-file`` cannot be read, holds no key, or has a malformed ``sha256:`` line."""


def digest(key: str) -> bytes:
    """SHA-256 digest of a key (32 bytes); what is stored and compared."""
    return hashlib.sha256(key.encode()).digest()


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header among raw ASGI ``headers``; None without one."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeys:
    """The accepted keys, as SHA-256 digests. ``check(token)``: constant-time membership."""

    def __init__(self, digests: Iterable[bytes]):
        self.digests = list(dict.fromkeys(digests))
        if not self.digests:
            raise ValueError("ApiKeys needs at least one key")

    @classmethod
    def load(
        cls, keys: Iterable[str] = (), key_file: str | os.PathLike | None = None, env: bool = True
    ) -> ApiKeys | None:
        """Keys from ``keys``, ``$FUSESERVE_API_KEY`` (when ``env``) and ``key_file``; None when there
        are none (auth off). Raises ``ApiKeyFileError`` for an unreadable or empty file, or a bad line."""
        digests = [digest(k) for k in keys if k]
        if env and os.environ.get(API_KEY_ENV):
            digests.append(digest(os.environ[API_KEY_ENV]))
        if key_file is not None:
            digests += read_key_file(key_file)
        return cls(digests) if digests else None

    def check(self, token: str | None) -> bool:
        """True when ``token`` is one of the keys; compares against every digest whatever matches."""
        if token is None:
            return False
        presented = digest(token)
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(presented, d)
        return ok


def read_key_file(path: str | os.PathLike) -> list[bytes]:
    """Digests of the keys in ``path`` (format in the module docstring). Raises ``ApiKeyFileError``."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"cannot read the API key file {path}: {e}") from None
    out = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(_SHA256_PREFIX):
            hexdigest = line[len(_SHA256_PREFIX) :].strip()
            try:
                raw = bytes.fromhex(hexdigest)
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise ApiKeyFileError(f"{path}:{number}: expected sha256:<64 hex digits>")
            out.append(raw)
        else:
            out.append(digest(line))
    if not out:
        raise ApiKeyFileError(f"the API key file {path} holds no key")
    return out


def unauthorized(token: str | None) -> JSONResponse:
    """The 401 answer: OpenAI's wording for a missing key, ``invalid_api_key`` for a wrong one."""
    if token is None:
        body = error_body(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            "invalid_request_error",
        )
    else:
        body = error_body("Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """ASGI middleware refusing HTTP requests without a valid key (see the module docstring).

    keys: the accepted keys. protect_metrics: ``/metrics`` needs a key too. on_refuse(status): called
    for every 401 (the gateway counts it with its other statuses).
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        protect_metrics: bool = False,
        on_refuse: Callable[[int], None] | None = None,
    ):
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        if not self.keys.check(token):
            client = scope.get("client")
            log.info(
                "%s %s: 401, %s API key (client %s)",
                scope["method"],
                scope["path"],
                "no" if token is None else "wrong",
                client[0] if client else "?",
            )
            if self.on_refuse is not None:
                self.on_refuse(401)
            await unauthorized(token)(scope, receive, send)
            return
        await self.app(scope, receive, send)
