"""Typed failures shared by every layer of fuseserve.

Each error carries the facts a user needs (names, numbers, paths) in its message; the gateway maps
them to OpenAI-style HTTP errors (``http_status``), the pipeline raises them as they are.
"""

from __future__ import annotations

import reprlib

_SHORT = reprlib.Repr()  # how an error message shows a rejected value: a 50 000-entry logit_bias not whole
_SHORT.maxstring = _SHORT.maxother = 120
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = 8
_SHORT.maxlong = 100


class FuseServeError(Exception):
    """Base class of every fuseserve error. ``http_status`` is the status the gateway answers with."""

    http_status: int = 500
    error_type: str = "server_error"


class ModelLoadError(FuseServeError):
    """A model path, alias or file is missing, unreadable or not a supported checkpoint."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture has no fuseserve implementation."""


class InvalidRequestError(FuseServeError):
    """A request is malformed; ``param`` names the offending field when there is one."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidParameterError(InvalidRequestError):
    """A sampling or generation parameter is outside its allowed range.

    Example: ``InvalidParameterError("top_p", 1.5, "0 < top_p <= 1")``.
    """

    def __init__(self, param: str, value: object, allowed: str):
        super().__init__(f"invalid {param}={_SHORT.repr(value)}: allowed {allowed}", param=param)
        self.value = value
        self.allowed = allowed


class ContextLengthExceededError(InvalidRequestError):
    """prompt tokens (+ max_new_tokens) exceed the model's context window (numbers in the message)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_model_len: int):
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_tokens} prompt tokens and asks for {max_new_tokens} new tokens "
            f"({prompt_tokens + max_new_tokens} in total)",
            param="max_tokens" if prompt_tokens < max_model_len else "prompt",
        )
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len


class KVCacheError(FuseServeError):
    """Base class of paged KV-cache allocator errors."""


class KVCacheFullError(KVCacheError):
    """An allocation asked for more blocks than are free; nothing was allocated."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"KV cache full: {requested} blocks requested, {free} free")
        self.requested = requested
        self.free = free


class DoubleFreeError(KVCacheError):
    """A block id was freed that is not currently allocated; nothing was freed."""


class InvalidBlockError(KVCacheError):
    """A block id outside ``[0, num_blocks)``; nothing was changed."""


class KVCacheTooSmallError(KVCacheError):
    """The configured KV memory cannot hold even one sequence of the model."""


class SchedulerError(FuseServeError):
    """An internal scheduling invariant failed."""


class QueueFullError(FuseServeError):
    """Too many requests are waiting; retry after ``retry_after`` seconds."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str = "too many requests waiting", retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class WorkerLostError(FuseServeError):
    """A worker cannot be reached (process gone, network down); its sequences recompute elsewhere."""


class WorkerFencedError(WorkerLostError):
    """The worker refused a plan or a free for a stale fencing token: another scheduler took its lease
    over. Lost to this scheduler (it stops driving the worker); the worker itself lives on.

    fence: the highest fencing token the worker has seen."""

    def __init__(self, message: str, fence: int = 0):
        super().__init__(message)
        self.fence = fence


class NoWorkerError(FuseServeError):
    """No live worker can take the request."""

    http_status = 503
    error_type = "service_unavailable"


class AttentionBackendUnavailableError(FuseServeError):
    """A forced attention backend cannot run here (package missing, no GPU, unsupported block size
    or dtype); the message says why."""


class LoRAAdapterNotServedError(InvalidRequestError):
    """No live worker serves the request's LoRA adapter (the gateway names it, the workers' records
    do not): failed at once with a 404 instead of waiting, or failing a pass on a worker."""

    http_status = 404

    def __init__(self, name: str):
        super().__init__(f"LoRA adapter {name!r} is served by no live worker", param="model")
        self.name = name


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter cannot be served: a missing or unreadable PEFT checkpoint, a rank above
    ``max_lora_rank``, a target module or PEFT feature fuseserve does not adapt, or weights shaped for
    another base model (the message names the adapter, the file and the fact)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"LoRA adapter {name!r}: {message}", param="lora_modules")
        self.name = name


class LoRAAdapterNotFoundError(InvalidRequestError):
    """No LoRA adapter of that name is loaded (``/v1/unload_lora_adapter``, ``unload_lora``)."""

    http_status = 404

    def __init__(self, name: str, loaded: list[str]):
        super().__init__(
            f"LoRA adapter {name!r} is not loaded; loaded: {loaded or 'none'}", param="lora_name"
        )


class LoRAAdapterInUseError(InvalidRequestError):
    """A LoRA adapter with running or waiting requests cannot be unloaded."""

    http_status = 409

    def __init__(self, name: str):
        super().__init__(
            f"LoRA adapter {name!r} has running or waiting requests; unload it once they finish",
            param="lora_name",
        )


class RuntimeLoRADisabledError(InvalidRequestError):
    """Loading and unloading LoRA adapters at runtime is off (``allow_runtime_lora``)."""

    http_status = 404

    def __init__(self):
        super().__init__(
            "loading LoRA adapters at runtime is off: start the gateway and the workers with "
            "--allow-runtime-lora (fuseserve serve --allow-runtime-lora; pipeline: allow_runtime_lora=True)"
        )
