"""A Python client for a running fuseserve gateway, with the pipeline's keyword arguments.

    client = fuseserve.Client("http://127.0.0.1:8000")
    client.generate(["What is 2+2?"], max_new_tokens=32, temperature=0.0)[0].text
    for piece in client.stream("Once upon a time", max_new_tokens=64):
        print(piece, end="")
    client.chat([{"role": "user", "content": "Hi"}]).text

Sampling keywords are those of :class:`fuseserve.SamplingParams` (``max_new_tokens``, ``temperature``,
``stop``, ...), validated here exactly as the pipeline validates them, with the same defaults, then
sent under their OpenAI names (``max_new_tokens`` → ``max_tokens``, ``min_new_tokens`` →
``min_tokens``). Token ids and logprobs come back through the gateway's ``return_token_ids``
extension. Gateway errors are raised as typed fuseserve errors: 4xx → ``InvalidRequestError``
(``http_status`` and ``param`` set from the answer), 429 → ``QueueFullError`` (``retry_after`` from
the header), 503 → ``NoWorkerError`` (no live worker or scheduler, or the gateway cannot reach
Redis), other 5xx → ``FuseServeError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from fuseserve.config import API_KEY_ENV
from fuseserve.errors import FuseServeError, InvalidRequestError, NoWorkerError, QueueFullError
from fuseserve.frontend.encode import as_batch, is_token_ids
from fuseserve.frontend.params import body_from_params
from fuseserve.outputs import Response
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import TokenLogprob

Prompt = str | list[int]


def _body(params: SamplingParams, chat: bool) -> dict[str, Any]:
    """OpenAI request fields for validated ``params`` (``fuseserve.frontend.params``' one table)."""
    body: dict[str, Any] = {**body_from_params(params), "return_token_ids": True}
    constraint = {
        name: value
        for name, value in (
            ("json", params.json_schema),
            ("regex", params.regex),
            ("choice", params.choice),
            ("grammar", params.grammar),
        )
        if value is not None
    }
    if constraint:  # vLLM's structured_outputs (docs/structured_output.md)
        body["structured_outputs"] = constraint
    if params.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
    if chat:
        body["logprobs"] = params.logprobs is not None
        body["top_logprobs"] = params.logprobs if params.logprobs is not None else None
    else:
        body["logprobs"] = params.logprobs
    return body


def error_from_answer(
    status: int, payload: dict | None, headers: httpx.Headers | None = None
) -> FuseServeError:
    """The typed error of a gateway error answer (OpenAI error JSON)."""
    err = (payload or {}).get("error") or {}
    message = str(err.get("message") or f"gateway answered HTTP {status}")
    if not err and isinstance((payload or {}).get("status"), str):  # /health: {"status": "no_scheduler"}
        message += f": {payload['status']}"
    if status == 429:
        retry = (headers or {}).get("retry-after")
        exc: FuseServeError = QueueFullError(message, retry_after=float(retry) if retry else 1.0)
    elif status == 503:
        exc = NoWorkerError(message)
    elif 400 <= status < 500:
        exc = InvalidRequestError(message, param=err.get("param"))
    else:
        exc = FuseServeError(message)
    exc.http_status = status
    exc.code = err.get("code")
    return exc


class Client:
    """Talks to a gateway over HTTP. ``url``: its base URL, with or without the OpenAI-style ``/v1``;
    ``timeout``: seconds per request; ``model``: the served name to ask for (default: the first of
    ``/v1/models``); ``api_key``: sent as ``Authorization: Bearer`` (default: ``$FUSESERVE_API_KEY``;
    a gateway without keys ignores it); ``lora``: the LoRA adapter every call runs with (None: the
    base model), sent as the request's ``model`` as the OpenAI API does; a call's own ``lora=``
    overrides it (the pipeline's keyword). A refused key raises ``InvalidRequestError`` with
    ``http_status`` 401."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 600.0,
        model: str | None = None,
        api_key: str | None = None,
        lora: str | None = None,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        api_key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)
        self._model = model
        self.lora = lora

    # ------------------------------------------------------------------ public API
    @property
    def model(self) -> str:
        """The model name requests are sent with (asked from the gateway once)."""
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def models(self) -> list[str]:
        """Names of the models the gateway serves."""
        return [m["id"] for m in self._request("GET", "/v1/models")["data"]]

    def health(self) -> dict:
        """The gateway's ``/health`` answer; raises ``NoWorkerError`` when it has no live worker or
        scheduler (message ends with "no_worker" / "no_scheduler") or cannot reach Redis."""
        return self._request("GET", "/health")

    def generate(
        self, prompts: Prompt | list[Prompt], lora: str | list[str | None] | None = None, **sampling: Any
    ) -> list[Response]:
        """One ``Response`` per prompt (text or token ids), in order, as ``Pipeline.__call__``;
        ``lora``: the adapter of every prompt or one per prompt (None: the client's).

        Raises ``InvalidParameterError`` / ``InvalidRequestError`` for bad keywords before sending,
        and the gateway's errors typed (see the module docstring).
        """
        batch = as_batch(prompts)  # the pipeline's rules: [] is an empty prompt (an error)
        params = SamplingParams.from_kwargs(**sampling)
        uniform = all(isinstance(p, str) for p in batch) or all(is_token_ids(p) for p in batch)
        loras = list(lora) if isinstance(lora, list | tuple) else [lora] * len(batch)
        if len(loras) != len(batch):
            raise InvalidRequestError(f"lora: {len(loras)} adapters for {len(batch)} prompts", param="lora")
        if uniform and len(set(loras)) == 1:
            groups = [(batch, loras[0])]
        else:
            groups = [([p], a) for p, a in zip(batch, loras, strict=True)]
        out: list[Response] = []
        for group, adapter in groups:
            body = {"model": self._model_for(adapter), "prompt": group, **_body(params, chat=False)}
            answer = self._request("POST", "/v1/completions", body)
            out.extend(self._response(c, c.get("text", "")) for c in answer["choices"])
        return out

    def stream(self, prompt: Prompt, lora: str | None = None, **sampling: Any) -> Iterator[str]:
        """Yield text deltas as they arrive; joined, they equal ``generate(prompt, lora)[0].text``."""
        params = SamplingParams.from_kwargs(**sampling)
        body = {"model": self._model_for(lora), "prompt": prompt, "stream": True, **_body(params, chat=False)}
        return self._stream("/v1/completions", body)

    def chat(self, messages: list[dict], lora: str | None = None, **sampling: Any) -> Response:
        """Apply the model's chat template on the gateway and generate one response (``lora``: as
        ``generate``'s)."""
        params = SamplingParams.from_kwargs(**sampling)
        body = {"model": self._model_for(lora), "messages": messages, **_body(params, chat=True)}
        answer = self._request("POST", "/v1/chat/completions", body)
        choice = answer["choices"][0]
        return self._response(choice, choice["message"].get("content") or "")

    def _model_for(self, lora: str | None) -> str:
        """The ``model`` of a request run with adapter ``lora`` (None: the client's, else the base)."""
        return lora or self.lora or self.model

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    @staticmethod
    def _response(choice: dict, text: str) -> Response:
        token_ids = list(choice.get("token_ids") or [])
        top = [
            [TokenLogprob(int(t), float(lp)) for t, lp in alts]
            for alts in choice.get("top_logprob_ids") or []
        ]
        return Response(
            text,
            token_ids,
            int(choice.get("prompt_tokens") or 0),
            len(token_ids),
            choice.get("finish_reason") or "abort",
            list(choice.get("token_logprobs") or []),
            top,
        )

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            answer = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise FuseServeError(f"cannot reach the gateway at {self.url}: {e}") from e
        if answer.status_code >= 400:
            raise error_from_answer(answer.status_code, _json_or_none(answer.content), answer.headers)
        return answer.json()

    def _stream(self, path: str, body: dict) -> Iterator[str]:
        try:
            with self._http.stream("POST", path, json=body) as answer:
                if answer.status_code >= 400:
                    raise error_from_answer(answer.status_code, _json_or_none(answer.read()), answer.headers)
                for line in answer.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise error_from_answer(int(chunk["error"].get("status") or 500), chunk)
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as e:
            raise FuseServeError(f"stream from the gateway at {self.url} failed: {e}") from e


def _json_or_none(content: bytes) -> dict | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
