"""``ServeOptions``: everything ``fuseserve serve`` runs with, as one option table (``fuseserve.options``).

It holds the model, the engine (``EngineConfig``), the front end the gateway runs, the processes and
their ports, the gateway's keys and limits (``RequestLimits``). ``fuseserve serve`` builds it from its
flags (``options.from_cli_args``), ``fuseserve.serve()`` from keywords (``options.from_keywords``); the
launcher gives each child the options its sub-command offers (``options.to_argv``, the API key by
``options.to_env``). The other sub-commands take the flags they share with ``serve`` from these rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fuseserve.config import API_KEY_ENV, DEFAULT_MODEL, EngineConfig, RequestLimits
from fuseserve.messages import DRAIN_TIMEOUT_S, LEASE_TTL_S
from fuseserve.options import option
from fuseserve.worker.latency_model import PRESETS

_FRONT_END = ("serve", "gateway")
_PRESETS = ", ".join(sorted(PRESETS))
_DRAIN = "on SIGTERM / Ctrl-C, {}; a second signal stops at once (default: %(default)g)"


@dataclass
class ServeOptions:
    """The options of ``fuseserve serve`` (its ``--help`` says what each does).

    model: alias, directory, .gguf file or Hugging Face Hub id. engine: the scheduler's and the
    workers' knobs. served_model_name, max_model_len, chat_template, tokenizer: the gateway's front
    end. workers, schedulers: processes; threads: torch threads per worker (None: allowed CPUs / workers).
    host, port: the gateway's. simulate, simulate_slowdown: simulated workers
    (``services/worker/sim_runner.py``) and their factors, cycled over the workers. drain_timeout:
    seconds the children get to finish on SIGTERM. lease_ttl: seconds a scheduler's worker leases live
    without a heartbeat (``messages.LeaseTimings``). api_key (handed over in ``$FUSESERVE_API_KEY``),
    api_key_file, protect_metrics, limits: the gateway's guards. log_level: every child's.
    """

    model: str = option(
        DEFAULT_MODEL,
        "model alias, Hugging Face checkpoint directory or .gguf file (default: %(default)s)",
        commands=("generate", "serve", "gateway", "worker"),
        help_for={"gateway": "model alias, directory or .gguf (tokenizer)"},
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: list[str] | None = option(
        None,
        "name(s) clients send as 'model'; the first is listed first (default: the model's name)",
        commands=_FRONT_END,
        metavar="NAME",
    )
    max_model_len: int | None = option(
        None,
        "context length in tokens, at most the model's (default: config max_position_embeddings)",
        commands=_FRONT_END,
    )
    chat_template: str | None = option(
        None, "Jinja chat template replacing the model's own", commands=_FRONT_END, metavar="FILE"
    )
    tokenizer: str | None = option(
        None,
        "tokenizer directory when the checkpoint has none (default: the model's own)",
        commands=_FRONT_END,
        metavar="DIR",
    )
    workers: int = option(1, "worker processes (default: %(default)s)", commands=("serve",))
    schedulers: int = option(
        1,
        "scheduler processes; each drives its share of the workers and takes over a dead one's "
        "(default: %(default)s)",
        commands=("serve",),
    )
    host: str = option(
        "127.0.0.1",
        "gateway host (default: %(default)s)",
        commands=_FRONT_END,
        help_for={"gateway": "bind host (default: %(default)s)"},
    )
    port: int = option(
        8000,
        "gateway port (default: %(default)s)",
        commands=_FRONT_END,
        help_for={"gateway": "bind port (default: %(default)s)"},
    )
    threads: int | None = option(
        None,
        "torch threads per worker (default: the CPUs this process may use / workers)",
        commands=("serve",),
    )
    simulate: str | None = option(
        None,
        "simulated workers: each runs plans against this latency model instead of a model; "
        f"the gateway still serves --model's tokenizer ({_PRESETS})",
        commands=("serve", "worker"),
        help_for={
            "worker": "no model: run plans against this latency model, sleep the modelled pass time "
            f"and return deterministic tokens; no torch, starts in about a second ({_PRESETS})"
        },
        metavar="PRESET",
        choices=sorted(PRESETS),
    )
    simulate_slowdown: str = option(
        "1",
        "multiply every simulated step's latency by F; a comma-separated list is cycled over "
        "the workers (1,3: worker-0 x1, worker-1 x3, ...) (default: %(default)s)",
        commands=("serve",),
        metavar="F[,F...]",
    )
    drain_timeout: float = option(
        DRAIN_TIMEOUT_S,
        _DRAIN.format("the scheduler(s) and workers get this many seconds to finish the sequences they run"),
        commands=("serve", "scheduler", "worker"),
        help_for={
            "scheduler": _DRAIN.format(
                "read no new requests and finish the unfinished ones within this many seconds, or "
                "hand them to another live scheduler at once"
            ),
            "worker": _DRAIN.format(
                "take no new sequences and finish the running ones within this many seconds; those "
                "left then recompute on other workers"
            ),
        },
        metavar="SECONDS",
    )
    lease_ttl: float = option(
        LEASE_TTL_S,
        "seconds a scheduler's worker leases and liveness live without its heartbeat (5 a TTL); a "
        "peer takes over a dead or stalled scheduler's workers and requests after this; every "
        "scheduler of a deployment must use the same (default: %(default)g)",
        commands=("serve", "scheduler"),
        metavar="SECONDS",
    )
    api_key: str | None = option(
        None,
        f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none: no key needed)",
        commands=_FRONT_END,
        env=API_KEY_ENV,
    )
    api_key_file: str | None = option(
        None,
        "accepted keys, one per line ('sha256:<hex>' lines are stored hashes); with --api-key",
        commands=_FRONT_END,
        metavar="PATH",
    )
    protect_metrics: bool = option(
        False, "/metrics needs an API key too (/health never does)", commands=_FRONT_END
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    log_level: str = "WARNING"
