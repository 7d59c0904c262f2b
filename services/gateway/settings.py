"""``GatewaySettings``: what one gateway needs, and the settings of the ``fuseserve gateway`` flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from fuseserve.config import DEFAULT_MODEL, EngineConfig, RequestLimits
from fuseserve.gateway.auth import ApiKeys
from fuseserve.messages import SCHEDULER_GRACE_S
from fuseserve.model_source import ModelSource
from fuseserve.options import from_cli_args


@dataclass
class GatewaySettings:
    """What a gateway needs.

    redis_url: the Redis of the stack. model: alias, directory or .gguf (only its tokenizer and
    config are loaded). served_model_name: the name(s) clients send as ``model`` (default: the
    model's name; the first one is listed first). max_queue: answer 429 while the scheduler has this
    many sequences waiting. limits: what one request may cost (``fuseserve.config.RequestLimits``;
    ``gateway/limits.py``). api_keys: accepted keys (None: no key needed; ``gateway/auth.py``).
    protect_metrics: ``/metrics`` needs a key too. max_model_len: context length in tokens
    (default: ``config.max_position_embeddings``; at most that). chat_template: a Jinja file replacing
    the model's template. tokenizer: a tokenizer directory replacing the model's (without either,
    only token-id prompts are served). admission_cache_s: seconds the worker / queue
    snapshot is reused. disconnect_poll_s: seconds between client-disconnect checks while waiting.
    redis_max_connections: pooled Redis connections shared by requests. redis_pool_timeout_s:
    seconds a request waits for a free one before its 503. scheduler_grace_s: seconds without a
    scheduler heartbeat before requests in flight fail (503). scheduler_check_s: seconds between
    heartbeat checks. source: an already resolved model (skips resolution; tests). quantization:
    ``--quantization`` (``gguf``: a .gguf model resolves to the quantized conversion the workers load,
    not to a float32 one). lora_modules: the LoRA adapters the workers serve (``NAME=PATH`` entries or a
    dict name → path; only the names are read): a request's ``model`` NAME selects one
    (``served_models.py``). allow_runtime_lora: serve ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (``lora_admin.py``; off: 404). max_lora_rank: the largest rank they
    accept (the workers' ``--max-lora-rank``).
    """

    redis_url: str
    model: str = DEFAULT_MODEL
    served_model_name: str | list[str] | None = None
    max_queue: int = 1024
    limits: RequestLimits = field(default_factory=RequestLimits)
    api_keys: ApiKeys | None = None
    protect_metrics: bool = False
    max_model_len: int | None = None
    chat_template: str | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None
    admission_cache_s: float = 0.25
    disconnect_poll_s: float = 0.25
    redis_max_connections: int = 64
    redis_pool_timeout_s: float = 5.0
    scheduler_grace_s: float = SCHEDULER_GRACE_S
    scheduler_check_s: float = 0.5
    source: ModelSource | None = None
    quantization: str | None = None
    lora_modules: list[str] | dict[str, str] | None = None
    allow_runtime_lora: bool = False
    max_lora_rank: int = EngineConfig.max_lora_rank


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Settings from the parsed ``fuseserve gateway`` flags (``fuseserve/service_cli.py``; the limits
    through their table, ``RequestLimits``). Raises ``ApiKeyFileError`` for a bad ``--api-key-file``."""
    return GatewaySettings(
        redis_url=args.redis_url,
        model=args.model,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        tokenizer=args.tokenizer,
        limits=from_cli_args(RequestLimits, args),
        api_keys=ApiKeys.load([args.api_key] if args.api_key else [], key_file=args.api_key_file),
        protect_metrics=args.protect_metrics,
        quantization=args.quantization,
        lora_modules=args.lora_modules,
        allow_runtime_lora=args.allow_runtime_lora,
        max_lora_rank=args.max_lora_rank,
    )
