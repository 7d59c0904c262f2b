"""Sub-commands of the persistent stack: serve, gateway, scheduler, worker.

The Docker Compose file runs exactly these commands (``docker-compose.yml``).
"""

from __future__ import annotations

import argparse

from fuseserve.worker.latency_model import PRESETS


def _redis(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", required=True, help="redis://host:port of the stack's Redis")


def _simulate(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--simulate",
        metavar="PRESET",
        choices=sorted(PRESETS),
        default=None,
        help=f"{what} ({', '.join(sorted(PRESETS))})",
    )


def _front_end(p: argparse.ArgumentParser) -> None:
    """Options of the request front end (the gateway's; ``serve`` passes them on)."""
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients send as 'model'; the first is listed first (default: the model's name)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens, at most the model's (default: config max_position_embeddings)",
    )
    p.add_argument(
        "--chat-template", default=None, metavar="FILE", help="Jinja chat template replacing the model's own"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer directory when the checkpoint has none (default: the model's own)",
    )


def _model_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model alias, directory, .gguf file or Hugging Face Hub id (same as --model)",
    )


def _with_model(a: argparse.Namespace) -> argparse.Namespace:
    """``serve MODEL`` / ``gateway MODEL``: the positional wins over --model."""
    if getattr(a, "model_positional", None):
        a.model = a.model_positional
    return a


def _serve(a):
    from fuseserve.launcher import run_serve

    a = _with_model(a)

    return run_serve(a)


def _gateway(a):
    from fuseserve.gateway.app import run_gateway

    a = _with_model(a)

    return run_gateway(a)


def _scheduler(a):
    from fuseserve.scheduler.service import run_scheduler

    return run_scheduler(a)


def _worker(a):
    from fuseserve.worker.server import run_worker

    return run_worker(a)


def add_parsers(sub, engine_args) -> None:
    """Register ``serve``, ``gateway``, ``scheduler`` and ``worker`` on the ``fuseserve`` parser."""
    s = sub.add_parser(
        "serve",
        help="start the whole stack locally (Redis, scheduler, workers, gateway)",
        description="Start Redis, the scheduler, N workers and the OpenAI-compatible gateway "
        "on this machine; Ctrl-C stops them all.",
    )
    _model_positional(s)
    engine_args(s)
    _front_end(s)
    s.add_argument("--workers", type=int, default=1, help="worker processes (default: 1)")
    s.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="scheduler processes; each drives its share of the workers and takes over a dead one's "
        "(default: 1)",
    )
    s.add_argument("--host", default="127.0.0.1", help="gateway host (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="gateway port (default: 8000)")
    s.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)"
    )
    _simulate(
        s,
        "simulated workers: each runs plans against this latency model instead of a model; "
        "the gateway still serves --model's tokenizer",
    )
    s.add_argument(
        "--simulate-slowdown",
        metavar="F[,F...]",
        default="1",
        help="multiply every simulated step's latency by F; a comma-separated list is cycled over "
        "the workers (1,3: worker-0 x1, worker-1 x3, ...) (default: 1)",
    )
    s.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks (processes) per worker (default: 1)"
    )
    s.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="the scheduler sends a worker its next plan only after its current result (default: overlap)",
    )
    s.set_defaults(func=_serve)

    g = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    _redis(g)
    _model_positional(g)
    g.add_argument(
        "--model", default="smollm2-135m-instruct", help="model alias, directory or .gguf (tokenizer)"
    )
    _front_end(g)
    g.add_argument("--host", default="127.0.0.1", help="bind host (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="bind port (default: 8000)")
    g.add_argument("--max-queue", type=int, default=1024, help="waiting sequences before 429 (default: 1024)")
    g.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)"
    )
    g.add_argument(
        "--metrics-port", type=int, default=None, help="unused: the gateway serves /metrics itself"
    )
    g.set_defaults(func=_gateway)

    c = sub.add_parser("scheduler", help="the central SplitFuse scheduler")
    _redis(c)
    c.add_argument(
        "--token-budget", type=int, default=None, help="tokens per pass (default: each worker's own)"
    )
    c.add_argument("--max-num-seqs", type=int, default=256, help="sequences per pass (default: 256)")
    c.add_argument("--policy", default="splitfuse", choices=["splitfuse", "prefill_first", "whole_prompt"])
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block (must match the workers)")
    c.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    c.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="send a worker its next plan only after its current result (default: overlap)",
    )
    c.set_defaults(func=_scheduler)

    w = sub.add_parser("worker", help="a model worker (gRPC), registers itself in Redis")
    _redis(w)
    engine_args(w)
    w.add_argument("--host", default="127.0.0.1", help="gRPC bind host (default: 127.0.0.1)")
    w.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default: 50051)")
    w.add_argument("--advertise-host", default=None, help="host name the scheduler dials (default: --host)")
    w.add_argument("--worker-id", default=None, help="registry id (default: hostname + random suffix)")
    w.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    w.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks (processes) this worker runs as (default: 1)",
    )
    w.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port; 0 picks a free one (registered in Redis)",
    )
    _simulate(
        w,
        "no model: run plans against this latency model, sleep the modelled pass time and "
        "return deterministic tokens; no torch, starts in about a second",
    )
    w.add_argument(
        "--simulate-slowdown",
        metavar="F",
        type=float,
        default=1.0,
        help="multiply every simulated step's latency by F > 0 (default: 1)",
    )
    w.set_defaults(func=_worker)
