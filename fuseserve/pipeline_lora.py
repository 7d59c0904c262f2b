"""The pipeline's runtime LoRA adapters: ``Pipeline.load_lora`` / ``unload_lora`` (the gateway's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` in process, ``services/gateway/lora_admin.py``).

Both need ``allow_runtime_lora=True``. A load runs the one checkpoint check
(``fuseserve.lora_checkpoint.check_runtime_load``), then the runner reads the weights against the
model (``LoRAManager.set_runtime``: shapes of another base model refused); they enter an adapter slot
when a request needs them. The adapter then joins ``lora_modules`` (what ``lora=`` may name). An
unload refuses an adapter with requests in flight and one the pipeline was built with.
"""

from __future__ import annotations

from pathlib import Path

from fuseserve.errors import (
    InvalidRequestError,
    LoRAAdapterError,
    LoRAAdapterInUseError,
    LoRAAdapterNotFoundError,
    RuntimeLoRADisabledError,
)
from fuseserve.lora_checkpoint import check_runtime_load


def load_lora(pipe, name: str, path: str | Path) -> None:
    """Serve the PEFT LoRA checkpoint ``path`` as ``name`` in ``pipe`` (a ``Pipeline``). Raises
    ``RuntimeLoRADisabledError``, ``InvalidRequestError`` / ``LoRAAdapterError`` (bad name or
    checkpoint, rank above ``max_lora_rank``, another base model's shapes)."""
    config = pipe.config
    if not config.allow_runtime_lora:
        raise RuntimeLoRADisabledError()
    path = str(path)
    check_runtime_load(name, path, config.max_lora_rank, [pipe.name], pipe.lora_names)
    runtime = {**pipe.runtime_loras, name: path}
    if name not in pipe.runner.set_runtime_loras(runtime):  # read and checked against the model
        pipe.runner.set_runtime_loras(pipe.runtime_loras)
        why = pipe.runner.lora.refused.pop(name, (path, f"{path} cannot be served"))[1]
        raise LoRAAdapterError(name, why.removeprefix(f"LoRA adapter {name!r}: "))
    pipe.runtime_loras = runtime
    config.lora_modules = [*(config.lora_modules or []), f"{name}={path}"]


def unload_lora(pipe, name: str) -> None:
    """Stop serving the runtime adapter ``name`` in ``pipe``. Raises ``RuntimeLoRADisabledError``,
    ``LoRAAdapterNotFoundError`` (not loaded), ``InvalidRequestError`` (one of the pipeline's
    ``lora_modules`` at construction), ``LoRAAdapterInUseError`` (requests in flight use it)."""
    config = pipe.config
    if not config.allow_runtime_lora:
        raise RuntimeLoRADisabledError()
    if name not in pipe.runtime_loras:
        if name in pipe.lora_names:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} was given at construction (lora_modules)", "lora"
            )
        raise LoRAAdapterNotFoundError(name, pipe.lora_names)
    if name in pipe.loras_in_flight():
        raise LoRAAdapterInUseError(name)
    runtime = {n: p for n, p in pipe.runtime_loras.items() if n != name}
    pipe.runner.set_runtime_loras(runtime)
    pipe.runtime_loras = runtime
    config.lora_modules = [e for e in config.lora_modules if e.partition("=")[0].strip() != name]
