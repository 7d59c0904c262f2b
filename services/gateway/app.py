"""The gateway: an OpenAI-compatible HTTP API in front of the Redis streams (``docs/architecture.md``, "Mode 2").

    app = create_app(GatewaySettings(redis_url="redis://localhost:6379", model="smollm2-135m-instruct"))

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as SSE when
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST
/detokenize`` (vLLM's shapes), ``POST /v1/(un)load_lora_adapter`` (``lora_admin.py``), ``GET /health``
(503 without a live scheduler or worker, or without Redis), ``GET /metrics`` (Prometheus). A request's
``model`` names the base model or one of its LoRA adapters (``served_models.py``). With API keys
configured every path but ``/health`` (and ``/metrics`` unless protected) needs one (``auth.py``);
``limits.py`` bounds what one request may cost. A request is validated, tokenized and checked against
the context and the scheduler's queue *before* anything is sent; then each sequence gets a ``seq_id``
(INCR), is XADDed to ``REQUESTS``, and its token events come back on this gateway's response stream.

Redis connections come from a blocking pool: under a burst a request waits up to
``redis_pool_timeout_s`` for a free connection, then gets a 503 (never a 500), as it does while
Redis is down. The response router has a small pool of its own, so it keeps reading meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import uuid

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect

from fuseserve.errors import FuseServeError, InvalidRequestError
from fuseserve.frontend.constraints import rendered_tools, tool_parser_factory
from fuseserve.frontend.model_info import build_encoder, generation_defaults, load_tokenizer
from fuseserve.frontend.openai_params import check_n, sampling_params
from fuseserve.gateway import utilities
from fuseserve.gateway.admission import Admission
from fuseserve.gateway.gateway_metrics import GatewayMetrics, MetricsMiddleware
from fuseserve.gateway.generation import ClientDisconnected, Generation, SequenceState, scheduler_error
from fuseserve.gateway.http_errors import RequestTooLargeError, error_for, install_handlers, validation_error
from fuseserve.gateway.limits import Limiter, install_guards
from fuseserve.gateway.lora_admin import install_lora_routes
from fuseserve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    field_policy,
    ignored_header,
)
from fuseserve.gateway.render import Renderer, sse
from fuseserve.gateway.served_models import ServedModels
from fuseserve.gateway.settings import GatewaySettings, settings_from_args
from fuseserve.gateway.streams import ResponseRouter
from fuseserve.messages import WorkerRecord
from fuseserve.model_source import resolve_model

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-fuseserve-ignored-fields"
"""Response header naming the unknown request fields that were ignored (comma-separated)."""


class Gateway:
    """Process-wide state of one app: model facts, Redis, the response router, metrics."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.source = settings.source or resolve_model(
            settings.model, cache_dir=settings.cache_dir, quantization=settings.quantization
        )
        names = settings.served_model_name or self.source.name
        self.model_names = [names] if isinstance(names, str) else list(names)
        self.model_name = self.model_names[0]
        self.served = ServedModels(self.model_names, settings.lora_modules, settings.allow_runtime_lora)
        self.tokenizer = load_tokenizer(self.source, settings.tokenizer)
        self.eos_token_ids = self.source.eos_token_ids()
        self.encoder = build_encoder(
            self.source,
            self.tokenizer,
            max_model_len=settings.max_model_len,
            chat_template=settings.chat_template,
        )
        self.max_model_len = self.encoder.max_model_len
        self.vocab_size = self.encoder.vocab_size
        self.defaults = generation_defaults(self.source.path)
        self.limiter = Limiter(settings.limits)
        self.gateway_id = uuid.uuid4().hex
        self.metrics = GatewayMetrics(self.model_name)
        self.redis: aioredis.Redis | None = None
        self.reader: aioredis.Redis | None = None  # the router's own client
        self.router: ResponseRouter | None = None
        self.admission: Admission | None = None

    def _connect(self, max_connections: int) -> aioredis.Redis:
        """A client on a blocking pool: waits ``redis_pool_timeout_s`` for a free connection, then
        raises ``ConnectionError``; one quick retry on a broken connection, not ten slow ones."""
        pool = aioredis.BlockingConnectionPool.from_url(
            self.settings.redis_url,
            decode_responses=True,
            max_connections=max_connections,
            timeout=self.settings.redis_pool_timeout_s,
            socket_connect_timeout=5.0,
            socket_timeout=30.0,  # longer than any blocking XREAD
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1),
        )
        return aioredis.Redis(connection_pool=pool)

    async def start(self) -> None:
        s = self.settings
        self.redis = self._connect(s.redis_max_connections)
        self.reader = self._connect(2)
        self.router = ResponseRouter(
            self.redis, self.gateway_id, self.reader, grace_s=s.scheduler_grace_s, check_s=s.scheduler_check_s
        )
        self.router.start()
        self.admission = Admission(self.redis, self.settings.max_queue, self.settings.admission_cache_s)
        log.info(
            "gateway %s serving %s (context %d tokens)", self.gateway_id, self.model_name, self.max_model_len
        )

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for client in (self.redis, self.reader):
            if client is not None:
                await client.aclose(close_connection_pool=True)

    # ------------------------------------------------------------------ request handling
    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object; 413 past ``limits.max_body_bytes`` (checked before parsing), else
        400 (not JSON, nested too deeply, not an object). Raises ``ClientDisconnect`` when the client
        goes away while sending it."""
        limit = self.settings.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise InvalidRequestError(f"invalid Content-Length header {declared!r}") from None
            if size > limit:
                raise RequestTooLargeError(size, limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(None, limit)
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequestError("the request body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return data

    def parse(self, model: type, data: dict):
        """The validated body and the unknown fields it ignores (see ``protocol.field_policy``)."""
        self.limiter.check_body(data)
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        ignored = field_policy(req)
        return req, ignored, self.check_model(req.model)

    async def live_workers(self) -> list[WorkerRecord]:
        """The live workers' records (``/v1/models`` reports their KV cache dtype); none while Redis
        is unreachable or before startup (the model card still answers)."""
        if self.admission is None:
            return []
        try:
            return await self.admission.worker_records()
        except RedisError as e:
            log.warning("cannot read the worker records: %s", e)
            return []

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter ``name`` selects (None: the base model, or no name); raises
        ``ModelNotFoundError`` (404) for a name that is not served (``served_models.py``)."""
        return self.served.adapter_of(name)

    def parse_plain(self, model: type, data: dict):
        """A validated utility body (``/tokenize``, ``/detokenize``) whose ``model`` is served."""
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        self.check_model(req.model)
        return req

    async def sequences(
        self, req: CompletionRequest | ChatCompletionRequest, chat: bool
    ) -> list[SequenceState]:
        """Tokenize, validate and give each of ``n`` sequences per prompt its seq_id (nothing sent yet)."""
        check_n(req.n)
        echo = not chat and req.echo
        if echo and req.stream:
            raise InvalidRequestError("echo is not supported with stream", param="echo")
        if chat:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            prompts = [self.encoder.chat(messages, rendered_tools(req))]
        else:
            prompts = self.encoder.encode_batch(req.prompt)
        lens = [len(ids) for ids in prompts]
        self.limiter.check_prompts(lens, "messages" if chat else "prompt")
        self.limiter.default_max_tokens(req, self.max_model_len - max(lens))
        plans = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                plans.append((p, ids, sampling_params(req, self.encoder, len(ids), j, chat, self.defaults)))
        await self.admission.check()
        seq_ids = await self.router.next_seq_ids(len(plans))
        new_parser = tool_parser_factory(req) if chat else None  # tool calls, per choice
        seqs = [
            SequenceState(choice, seq_id, p, ids, params, self.tokenizer, new_parser and new_parser())
            for choice, ((p, ids, params), seq_id) in enumerate(zip(plans, seq_ids, strict=True))
        ]
        if echo:
            texts = req.prompt if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else None
            texts = [req.prompt] if isinstance(req.prompt, str) else texts
            for s in seqs:
                s.echo = texts[s.prompt_index] if texts else self.tokenizer.decode(s.prompt_ids)
                s.echo_only = req.max_tokens == 0
        return seqs

    async def generate(self, request: Request, chat: bool):
        arrival = time.monotonic()
        try:
            data = await self.read_json(request)
        except ClientDisconnect:  # gone while uploading: nothing to answer, nothing to log loudly
            log.info("%s %s: client disconnected while sending the body", request.method, request.url.path)
            return Response(status_code=499)
        await self.served.refresh(self.redis, data.get("model"))
        req, ignored, lora = self.parse(ChatCompletionRequest if chat else CompletionRequest, data)
        headers = {IGNORED_FIELDS_HEADER: ignored_header(ignored)} if ignored else {}
        seqs = await self.sequences(req, chat)
        gen = Generation(
            self.router,
            self.metrics,
            seqs,
            request_id=uuid.uuid4().hex,
            is_disconnected=request.is_disconnected,
            cache_salt=req.cache_salt,
            lora=lora,
            poll_s=self.settings.disconnect_poll_s,
        )
        gen.arrival = arrival
        renderer = Renderer(self.tokenizer, req.model, chat, req.return_token_ids)
        await gen.submit()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(gen, renderer, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        try:
            await gen.run()
        except ClientDisconnected:
            return Response(status_code=499)
        except BaseException:
            gen.abort()  # cancelled (server shutdown) or failed: free the sequences
            raise
        self.metrics.e2e.observe(time.monotonic() - arrival)
        return JSONResponse(renderer.response(seqs), headers=headers)

    async def _stream(self, gen: Generation, renderer: Renderer, include_usage: bool):
        try:
            first = renderer.role_chunk(gen.seqs, include_usage)
            if first is not None:
                yield sse(first)
            async for deltas in gen.batches():
                if gen.error is not None:  # the text that came before the error is sent; the error event ends
                    for d in deltas.values():
                        d.finished = False
                chunk = renderer.delta_chunk(gen.seqs, deltas, include_usage)
                if chunk is not None:
                    yield sse(chunk)
            if gen.error is not None:
                exc = scheduler_error(gen.error)
                body = error_for(exc)
                body["error"]["status"] = exc.http_status
                yield sse(body)
            else:
                if include_usage:
                    yield sse(renderer.usage_chunk(gen.seqs))
                self.metrics.e2e.observe(time.monotonic() - gen.arrival)
            yield sse("[DONE]")
        except ClientDisconnected:
            pass
        finally:
            if not gen.finished:
                gen.abort()

    async def health(self) -> JSONResponse:
        """200 ``{"status": "ok", "workers": n}``; 503 with status "no_scheduler" or "no_worker";
        503 OpenAI error JSON when Redis cannot be reached (the app's handler)."""
        snap = await self.admission.snapshot(fresh=True)
        if not snap.scheduler_alive:
            return JSONResponse({"status": "no_scheduler", "workers": snap.num_workers}, status_code=503)
        if snap.num_workers == 0:
            return JSONResponse({"status": "no_worker", "workers": 0}, status_code=503)
        return JSONResponse({"status": "ok", "workers": snap.num_workers})


def create_app(settings: GatewaySettings) -> FastAPI:
    """The gateway's FastAPI app; loads the tokenizer now, connects to Redis on startup.

    Raises ``ModelLoadError`` when the model cannot be resolved or has no tokenizer.
    """
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="fuseserve gateway", lifespan=lifespan)
    app.state.gateway = gw
    install_handlers(app)
    install_guards(app, settings.limits, settings.api_keys, settings.protect_metrics)
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)  # added last: outermost, sees every status

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gw.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await gw.generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        await gw.served.refresh(gw.redis)
        workers = await gw.live_workers()
        return {"object": "list", "data": [utilities.model_card(gw, n, workers) for n in gw.served.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        await gw.served.refresh(gw.redis, model_id)
        gw.check_model(model_id)
        return utilities.model_card(gw, model_id, await gw.live_workers())

    install_lora_routes(app, gw)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return utilities.tokenize(gw, gw.parse_plain(TokenizeRequest, await gw.read_json(request)))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return utilities.detokenize(gw, gw.parse_plain(DetokenizeRequest, await gw.read_json(request)))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and curl -I's probes
    async def health():
        return await gw.health()

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.exposition(), media_type=gw.metrics.content_type)

    return app


def run_gateway(args: argparse.Namespace) -> int:
    """``fuseserve gateway``: serve the app with uvicorn until interrupted; returns the exit code.

    ``args``: the parsed ``fuseserve gateway`` flags (``settings_from_args``; ``host``, ``port``,
    ``log_level``).
    """
    import uvicorn

    level = args.log_level.lower()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings_from_args(args))
    except FuseServeError as e:
        log.error("%s", e)
        return 1
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, timeout_graceful_shutdown=5)
    return 0


__all__ = ["GatewaySettings", "create_app", "run_gateway", "settings_from_args"]
