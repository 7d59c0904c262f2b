"""The gateway's Prometheus metrics, in a registry of their own (one per app, so tests can build several).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` → ``fuseserve_time_to_first_token_seconds``)
and every series carries ``model_name``. The gateway owns what a client sees: latencies, tokens
delivered, outcomes, HTTP statuses and requests in flight. Queue lengths, passes and KV use belong to
the scheduler and the workers (``fuseserve.scheduler.service.scheduler_metrics``,
``fuseserve.worker.worker_metrics``); the full list with meanings is ``monitoring/README.md``.

Each counted thing is counted once, where it happens: a sequence's outcome when it finishes
(``Generation`` calls ``count_finished`` exactly once per sequence), a token when its event is first
applied (duplicates resent after a scheduler failover are dropped before counting), an HTTP status
when the response starts (``MetricsMiddleware``).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5)
FINISHED_REASONS = ("stop", "length", "abort", "error")
"""Values of ``finished_reason`` on ``fuseserve_request_success_total``."""


class GatewayMetrics:
    """The metrics of one gateway app serving ``model_name``, registered in ``self.registry``.

    Attributes are label-bound children, ready to ``observe``/``inc``:
    ``ttft``, ``itl``, ``e2e`` (seconds), ``prompt_tokens``, ``generation_tokens`` (tokens),
    ``in_flight`` (HTTP generation requests being served).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = {"model_name": model_name}
        label = ["model_name"]
        self.ttft = Histogram(
            "fuseserve_time_to_first_token_seconds",
            "Arrival of a request to its first generated token (seconds)",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**m)
        self.itl = Histogram(
            "fuseserve_inter_token_latency_seconds",
            "Gap between successive tokens of one sequence (seconds)",
            label,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(**m)
        self.e2e = Histogram(
            "fuseserve_e2e_request_latency_seconds",
            "Arrival to last token of a request that finished without error (seconds)",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**m)
        self.prompt_tokens = Counter(
            "fuseserve_prompt_tokens", "Prompt tokens of sequences handed to the scheduler", label, registry=r
        ).labels(**m)
        self.generation_tokens = Counter(
            "fuseserve_generation_tokens",
            "Generated tokens delivered to requests (hidden EOS/stop ids included, as in usage)",
            label,
            registry=r,
        ).labels(**m)
        self._success = Counter(
            "fuseserve_request_success",
            "Finished sequences by finished_reason (stop, length, abort, error)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in FINISHED_REASONS:
            self._success.labels(model_name=model_name, finished_reason=reason)
        self._http = Counter(
            "fuseserve_http_requests",
            "HTTP requests answered, by status code (499: the client went away first)",
            ["model_name", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "fuseserve_num_requests_in_flight",
            "Generation requests being served by this gateway (body read to last byte sent)",
            label,
            registry=r,
        ).labels(**m)

    def count_finished(self, reason: str) -> None:
        """Count one sequence that finished with ``reason`` (one of ``FINISHED_REASONS``)."""
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def count_http(self, status: int) -> None:
        """Count one HTTP response by its status code."""
        self._http.labels(model_name=self.model_name, status=str(status)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP response's status and, for ``POST /v1/*``, keeps the
    requests-in-flight gauge (incremented on entry, decremented once when the app returns, which
    for a stream is after its last byte or the client's disconnect).

    A request whose app raised before answering counts as 500; one that ended without a response
    (the client left first) as 499.
    """

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        generation = scope["method"] == "POST" and scope["path"].startswith("/v1/")
        if generation:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            if not status:
                status.append(500)
            raise
        finally:
            if generation:
                self.metrics.in_flight.dec()
            self.metrics.count_http(status[0] if status else 499)
