"""Loading and unloading LoRA adapters at runtime, vLLM's endpoints (``--allow-runtime-lora``).

``POST /v1/load_lora_adapter`` with ``{"lora_name": NAME, "lora_path": DIR}`` and
``POST /v1/unload_lora_adapter`` with ``{"lora_name": NAME}``; both need the API key like every other
endpoint (``auth.py``) and answer 404 while runtime loading is off. The one source of truth is the
Redis hash ``messages.RUNTIME_LORA`` (name → path):

- load checks the checkpoint (``fuseserve.lora_checkpoint.check_runtime_load``, the check the
  pipeline and the workers run too: 400 for a bad path, a checkpoint that is not a PEFT LoRA, a rank
  above ``--max-lora-rank``, an unserved target, a name taken by the base model or a loaded adapter),
  adds the entry, and answers once every scheduler that drives workers has a worker advertising it
  (``_served``; workers read the hash at each heartbeat, ``services/worker/registration.py``, and
  read the weights then; they enter an adapter slot only when a request needs them). When no worker can serve it within
  ``LOAD_WAIT_S`` (another base model's shapes, a path the workers cannot read) the entry is removed
  and the answer is a 400.
- unload refuses (409) while a sequence of the adapter is running or waiting: on this gateway
  (``ResponseRouter.loras_in_flight``) or in any scheduler (their stats records, at most
  ``STATS_INTERVAL_S`` old); an unknown name is a 404, an adapter of ``--lora-modules`` a 400.

Every gateway reads the hash (``served_models.ServedModels.refresh``), so all answer to the name.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from fuseserve.errors import (
    InvalidRequestError,
    LoRAAdapterError,
    LoRAAdapterInUseError,
    LoRAAdapterNotFoundError,
    RuntimeLoRADisabledError,
)
from fuseserve.lora_checkpoint import check_runtime_load
from fuseserve.messages import RUNTIME_LORA

log = logging.getLogger(__name__)

LOAD_WAIT_S = 30.0
"""Seconds a load waits for the workers to advertise the adapter before it is refused."""
_POLL_S = 0.1


def install_lora_routes(app: FastAPI, gw) -> None:
    """Add the two endpoints to ``app`` for the gateway ``gw`` (``app.Gateway``)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await load(gw, await _body(gw, request))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await unload(gw, await _body(gw, request))


async def _body(gw, request: Request) -> dict:
    if not gw.settings.allow_runtime_lora:
        raise RuntimeLoRADisabledError()
    return await gw.read_json(request)


async def load(gw, body: dict) -> PlainTextResponse:
    """Load the adapter ``body["lora_name"]`` from ``body["lora_path"]`` (see the module docstring)."""
    served = gw.served
    name, path = body.get("lora_name"), body.get("lora_path")
    await served.refresh(gw.redis)
    check_runtime_load(name, path, gw.settings.max_lora_rank, served.base_names, served.lora_names)
    if not await gw.redis.hsetnx(RUNTIME_LORA, name, path):  # another gateway was faster
        raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded; unload it first", "lora_name")
    await served.refresh(gw.redis)
    deadline = time.monotonic() + LOAD_WAIT_S
    while not await _served(gw, name):
        if time.monotonic() > deadline:
            await _remove(gw, name, path)
            raise LoRAAdapterError(
                name,
                f"no worker serves {path} after {LOAD_WAIT_S:g} s (readable on the workers' hosts? "
                "the same base model? the workers' logs say; workers started with --allow-runtime-lora?)",
            )
        await asyncio.sleep(_POLL_S)
    log.info("LoRA adapter %s loaded from %s", name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _served(gw, name: str) -> bool:
    """Every scheduler that drives workers has one advertising ``name``; while none drives a worker
    (they are starting), some live worker advertises it, or there is no worker at all (one that
    starts later reads the hash)."""
    served_by = (await gw.admission.scheduler_stats()).get("lora_served")
    if served_by is not None:
        return name in served_by
    records = await gw.admission.worker_records()
    return not records or any(name in r.lora_adapters for r in records)


async def unload(gw, body: dict) -> PlainTextResponse:
    """Unload the runtime adapter ``body["lora_name"]`` (see the module docstring)."""
    served = gw.served
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise InvalidRequestError(f"lora_name must be an adapter's name, got {name!r}", "lora_name")
    if name in served.static_names:
        raise InvalidRequestError(
            f"LoRA adapter {name!r} is served from --lora-modules; it is not unloaded at runtime", "lora_name"
        )
    await served.refresh(gw.redis)
    path = served.runtime_paths.get(name)
    if path is None:
        raise LoRAAdapterNotFoundError(name, served.lora_names)
    in_use = gw.router.loras_in_flight() | (await gw.admission.scheduler_stats()).get("lora_in_use", set())
    if name in in_use:
        raise LoRAAdapterInUseError(name)
    await _remove(gw, name, path)
    log.info("LoRA adapter %s unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


_REMOVE_LUA = "if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('hdel', KEYS[1], ARGV[1]) end return 0"


async def _remove(gw, name: str, path: str) -> None:
    """Delete ``name`` from the hash while it still holds ``path`` (not a later load's), then re-read."""
    await gw.redis.eval(_REMOVE_LUA, 1, RUNTIME_LORA, name, path)
    await gw.served.refresh(gw.redis)
