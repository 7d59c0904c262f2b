"""The gateway's Prometheus metrics, in a registry of their own (one per app, so tests can build several).

Names (the Grafana dashboard and alert rules use them):

- ``fuseserve_requests_total{status}``: finished HTTP requests; status "ok", "error" (5xx),
  "client_error" (4xx) or "abort" (the client went away).
- ``fuseserve_request_latency_seconds``: arrival to last byte of a generation request.
- ``fuseserve_ttft_seconds``: arrival to the first generated token of a request.
- ``fuseserve_inter_token_latency_seconds``: gap between successive tokens of one sequence.
- ``fuseserve_generated_tokens_total`` / ``fuseserve_prompt_tokens_total``: tokens, all requests.
- ``fuseserve_queue_depth``: sequences waiting in the scheduler (its ``SCHEDULER_STATS``).
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

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5)


class GatewayMetrics:
    """Counters and histograms of one gateway app, registered in ``self.registry``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fuseserve_requests", "Finished HTTP requests by outcome", ["status"], registry=r
        )
        self.latency = Histogram(
            "fuseserve_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "fuseserve_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "fuseserve_inter_token_latency_seconds", "Time between tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.generated_tokens = Counter("fuseserve_generated_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("fuseserve_prompt_tokens", "Prompt tokens", registry=r)
        self.queue_depth = Gauge("fuseserve_queue_depth", "Sequences waiting in the scheduler", registry=r)
        for status in ("ok", "error", "client_error", "abort"):
            self.requests.labels(status=status)

    def count_status(self, http_status: int) -> None:
        """Count one answered request by its HTTP status."""
        if http_status >= 500:
            self.requests.labels(status="error").inc()
        elif http_status >= 400:
            self.requests.labels(status="client_error").inc()
        else:
            self.requests.labels(status="ok").inc()

    def count_abort(self) -> None:
        self.requests.labels(status="abort").inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
