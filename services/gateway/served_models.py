"""The names a gateway serves: the base model's and its LoRA adapters' (vLLM's ``--lora-modules``).

A request's ``model`` picks what runs: a name of the base model (``--served-model-name``, default the
model's own) runs the base model; an adapter's name runs the base model with that adapter (the
``lora`` of its ``RequestMessage``, which the scheduler puts on the ``Sequence``); any other name is
a 404. ``/v1/models`` lists the base names, then the adapters, each with ``parent`` set to the base
model's id (OpenAI's and vLLM's model card). The gateway reads only the adapters' names; the workers
load their weights (``services/worker/lora_manager.py``). Adapters loaded at runtime
(``lora_admin.py``) live in the Redis hash ``messages.RUNTIME_LORA``, the one source every gateway
reads (``refresh``).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from fuseserve.config import EngineConfig
from fuseserve.errors import InvalidParameterError
from fuseserve.gateway.http_errors import ModelNotFoundError
from fuseserve.messages import RUNTIME_LORA


class ServedModels:
    """The model names one gateway answers to.

    base_names: the base model's names (the first is its id). lora_modules: the adapters,
    ``NAME=PATH`` entries or a dict name → path (``EngineConfig.lora_modules``; None: none).
    runtime: read the adapters loaded at runtime too (``--allow-runtime-lora``).
    Raises ``InvalidParameterError`` for a malformed entry or an adapter named like the base model.
    """

    def __init__(
        self,
        base_names: list[str],
        lora_modules: list[str] | dict[str, str] | None = None,
        runtime: bool = False,
    ):
        self.base_names = list(base_names)
        self.static_names = list(EngineConfig(lora_modules=lora_modules).lora_paths())
        for name in self.static_names:
            if name in self.base_names:
                raise InvalidParameterError("lora_modules", name, "adapter names other than the model's")
        self.runtime = runtime
        self.runtime_paths: dict[str, str] = {}  # the hash's adapters, as last read

    async def refresh(self, redis: aioredis.Redis | None, name: object = None) -> None:
        """Re-read the runtime adapters (``messages.RUNTIME_LORA``: one small HGETALL, so every gateway
        sees a load or an unload at once) unless runtime loading is off or ``name`` (a request's
        ``model``) is a base or startup name. Raises ``redis.exceptions.RedisError`` when Redis fails."""
        if not self.runtime or redis is None or name in self.base_names or name in self.static_names:
            return
        self.runtime_paths = await redis.hgetall(RUNTIME_LORA)

    @property
    def base(self) -> str:
        """The base model's id (the ``parent`` of every adapter)."""
        return self.base_names[0]

    @property
    def lora_names(self) -> list[str]:
        """The adapters: those of ``lora_modules``, then those loaded at runtime (sorted)."""
        return self.static_names + sorted(n for n in self.runtime_paths if n not in self.static_names)

    @property
    def names(self) -> list[str]:
        """Every served name, as ``/v1/models`` lists them: the base names, then the adapters."""
        return self.base_names + self.lora_names

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` runs with: None for the base model (or no name).
        Raises ``ModelNotFoundError`` (404) for a name that is neither."""
        if name is None or name in self.base_names:
            return None
        if name in self.lora_names:
            return name
        raise ModelNotFoundError(name, ", ".join(self.names))

    def parent_of(self, name: str) -> str | None:
        """``name``'s parent model: the base model's id for an adapter, None for a base name."""
        return self.base if name in self.lora_names else None
