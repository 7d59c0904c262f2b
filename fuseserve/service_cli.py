"""Sub-commands of the persistent stack: serve, gateway, scheduler, worker.

The Docker Compose file runs exactly these commands (``docker-compose.yml``). The flags a command
shares with ``serve`` come from serve's option table (``fuseserve.serve_options.ServeOptions``, which
nests ``EngineConfig`` and ``RequestLimits``; ``fuseserve.options.add_cli_args``); what only one
process has (its Redis, its address, its metrics port) is declared here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from fuseserve.options import add_cli_args, from_cli_args
from fuseserve.redis_launcher import REDIS_PASSWORD_ENV, check_redis_auth, with_password
from fuseserve.serve_options import ServeOptions


def _redis(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        required=True,
        help="redis://[:password@]host:port of the stack's Redis (prefer --redis-password or "
        "$FUSESERVE_REDIS_PASSWORD for the password: argv is visible to other users)",
    )
    p.add_argument(
        "--redis-password",
        default=None,
        help=f"Redis AUTH password (default: ${REDIS_PASSWORD_ENV}, else the one in --redis-url)",
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
    if a.model_positional:
        a.model = a.model_positional
    return a


def serve_options(a: argparse.Namespace) -> ServeOptions:
    """The ``ServeOptions`` of parsed ``fuseserve serve`` flags (a positional MODEL wins over --model)."""
    return dataclasses.replace(from_cli_args(ServeOptions, _with_model(a)), log_level=a.log_level)


def _serve(a):
    from fuseserve.launcher import run_serve

    return run_serve(serve_options(a))


def _authenticated(a: argparse.Namespace) -> argparse.Namespace:
    """``a.redis_url`` with the password of ``--redis-password`` / ``$FUSESERVE_REDIS_PASSWORD`` folded
    in; raises ``RedisAuthError`` (one line, no traceback from ``fuseserve.cli``) when Redis refuses it."""
    a.redis_url = with_password(a.redis_url, a.redis_password)
    check_redis_auth(a.redis_url)
    return a


def _gateway(a):
    from fuseserve.gateway.app import run_gateway

    return run_gateway(_authenticated(_with_model(a)))


def _scheduler(a):
    from fuseserve.scheduler.service.scheduler_service import run_scheduler

    return run_scheduler(_authenticated(a))


def _worker(a):
    from fuseserve.worker.server import run_worker

    rc = run_worker(_authenticated(a))
    # the worker released all it owns (record, server, ranks); skip the interpreter's teardown of
    # torch's state, which took 1.8 s on the dev machine: a drained worker's exit is what a rolling
    # update and a KV migration wait for
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def add_parsers(sub) -> None:
    """Register ``serve``, ``gateway``, ``scheduler`` and ``worker`` on the ``fuseserve`` parser."""
    s = sub.add_parser(
        "serve",
        help="start the whole stack locally (Redis, scheduler, workers, gateway)",
        description="Start Redis, the scheduler, N workers and the OpenAI-compatible gateway "
        "on this machine; Ctrl-C stops them all.",
    )
    _model_positional(s)
    add_cli_args(s, ServeOptions, "serve")
    s.set_defaults(func=_serve)
    _gateway_parser(sub)
    _scheduler_parser(sub)
    _worker_parser(sub)


def _gateway_parser(sub) -> None:
    g = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    _redis(g)
    _model_positional(g)
    add_cli_args(g, ServeOptions, "gateway")
    g.add_argument("--max-queue", type=int, default=1024, help="waiting sequences before 429 (default: 1024)")
    g.add_argument(
        "--metrics-port", type=int, default=None, help="unused: the gateway serves /metrics itself"
    )
    g.set_defaults(func=_gateway)


def _scheduler_parser(sub) -> None:
    c = sub.add_parser("scheduler", help="the central SplitFuse scheduler")
    _redis(c)
    add_cli_args(c, ServeOptions, "scheduler")
    c.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: a free one)"
    )
    c.add_argument(
        "--advertise-host",
        default=None,
        help="host name or address fuseserve top reaches the metrics at (default: this host's name)",
    )
    c.set_defaults(func=_scheduler)


def _threads(text: str) -> int:
    """``--threads``: an integer >= 0 (argparse reports anything else as one line)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0 (0: torch's choice)")
    return int(text)


def _worker_parser(sub) -> None:
    w = sub.add_parser("worker", help="a model worker (gRPC), registers itself in Redis")
    _redis(w)
    add_cli_args(w, ServeOptions, "worker")
    w.add_argument("--host", default="127.0.0.1", help="gRPC bind host (default: 127.0.0.1)")
    w.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default: 50051)")
    w.add_argument("--advertise-host", default=None, help="host name the scheduler dials (default: --host)")
    w.add_argument("--worker-id", default=None, help="registry id (default: hostname + random suffix)")
    w.add_argument(
        "--threads", type=_threads, default=None, help="torch CPU threads (default, or 0: torch's choice)"
    )
    w.add_argument(
        "--cpu-bind",
        default="auto",
        metavar="auto|none|CPU[,CPU...]",
        help="bind the torch threads one per CPU: auto binds when this process may run on exactly as "
        "many CPUs as it has threads (default: %(default)s)",
    )
    w.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port; 0 picks a free one (registered in Redis)",
    )
    w.add_argument(
        "--simulate-slowdown",
        metavar="F",
        type=float,
        default=1.0,
        help="multiply every simulated step's latency by F > 0 (default: 1)",
    )
    w.set_defaults(func=_worker)
