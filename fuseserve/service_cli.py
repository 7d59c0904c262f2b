"""Sub-commands of the persistent stack: serve, gateway, scheduler, worker.

The Docker Compose file runs exactly these commands (``docker-compose.yml``).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from fuseserve.config import API_KEY_ENV, RequestLimits
from fuseserve.messages import DRAIN_TIMEOUT_S
from fuseserve.redis_launcher import REDIS_PASSWORD_ENV, check_redis_auth, with_password
from fuseserve.worker.latency_model import PRESETS


def _no_prefix_caching(p) -> None:
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt from its first token (default: reuse the KV of cached prefixes)",
    )


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


def _guards(p: argparse.ArgumentParser) -> None:
    """The gateway's API-key and per-request-limit options (README "Security")."""
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none: no key needed)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="accepted keys, one per line ('sha256:<hex>' lines are stored hashes); with --api-key",
    )
    p.add_argument(
        "--protect-metrics", action="store_true", help="/metrics needs an API key too (/health never does)"
    )
    for f in fields(RequestLimits):
        default = "none: the context length" if f.default is None else f.default
        p.add_argument(
            f.metadata["flag"],
            dest=f.name,
            type=int,
            default=None,
            help=f"{f.metadata['help']}; refused with {f.metadata['status']} (default: {default})",
        )


def _drain(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        default=DRAIN_TIMEOUT_S,
        help=f"on SIGTERM / Ctrl-C, {what}; a second signal stops at once (default: {DRAIN_TIMEOUT_S:g})",
    )


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


def _authenticated(a: argparse.Namespace) -> argparse.Namespace:
    """``a.redis_url`` with the password of ``--redis-password`` / ``$FUSESERVE_REDIS_PASSWORD`` folded
    in; raises ``RedisAuthError`` (one line, no traceback from ``fuseserve.cli``) when Redis refuses it."""
    a.redis_url = with_password(a.redis_url, a.redis_password)
    check_redis_auth(a.redis_url)
    return a


def _gateway(a):
    from fuseserve.gateway.app import run_gateway

    a = _with_model(a)
    return run_gateway(_authenticated(a))


def _scheduler(a):
    from fuseserve.scheduler.service import run_scheduler

    return run_scheduler(_authenticated(a))


def _worker(a):
    from fuseserve.worker.server import run_worker

    return run_worker(_authenticated(a))


def slo_args(p: argparse.ArgumentParser) -> None:
    """``--target-itl`` / ``--target-prefill-rate``: latency targets that size each SplitFuse pass
    (``fuseserve.config.EngineConfig``; ``docs/architecture.md``, "SLO-driven token budget")."""
    p.add_argument(
        "--target-itl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="inter-token latency to keep: each SplitFuse pass is sized from the measured latency "
        "curve to stay within it (default: off, the fixed token budget)",
    )
    p.add_argument(
        "--target-prefill-rate",
        type=float,
        default=None,
        metavar="TOKENS_PER_S",
        help="TTFT target = prompt tokens / this rate; prompts run earliest deadline first and "
        "passes grow (within --target-itl) as deadlines need (default: off)",
    )


def decode_passes_arg(p: argparse.ArgumentParser) -> None:
    """``--decode-passes K``: multi-step decoding (``EngineConfig.decode_passes``)."""
    p.add_argument(
        "--decode-passes",
        type=int,
        default=1,
        metavar="K",
        help="decode passes per plan when a worker's pass holds decodes only and no request waits: "
        "one round trip for K tokens per sequence (default: 1)",
    )


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
    slo_args(s)
    decode_passes_arg(s)
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
    _no_prefix_caching(s)
    _drain(
        s,
        "the scheduler(s) and workers get this many seconds to finish the sequences they run",
    )
    _guards(s)
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
    _guards(g)
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
    c.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: a free one)"
    )
    slo_args(c)
    decode_passes_arg(c)
    c.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="send a worker its next plan only after its current result (default: overlap)",
    )
    _no_prefix_caching(c)
    _drain(
        c,
        "read no new requests and finish the unfinished ones within this many seconds, or hand them "
        "to another live scheduler at once",
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
    _drain(
        w,
        "take no new sequences and finish the running ones within this many seconds; those left "
        "then recompute on other workers",
    )
    w.set_defaults(func=_worker)
