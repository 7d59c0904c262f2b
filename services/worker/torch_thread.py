"""One thread for all of a process's model work: load, budget profiling, passes, KV moves.

PyTorch's CPU kernels run in OpenMP parallel regions (libgomp on Linux). libgomp gives every thread
that starts a parallel region a team of worker threads of its own, kept until that thread exits, and
once the process's OpenMP threads outnumber its CPUs it stops spinning at barriers (its "throttled"
spin count) and sleeps instead, so every parallel region then pays a futex wake-up. A model loaded
on one thread (the main one) and run on another (the engine's lane, a gRPC stream's) therefore ran
every pass slower: SmolLM2, a 128-token pass on 2 vCPUs, 232 / 237 ms when built and run on the same
thread against 336 / 388 ms built on the main thread (``benchmarks/README.md``, "Where the served CPU
goes"). ``GOMP_SPINCOUNT`` does not lift the throttle; one thread for all model work does.

``on_torch_thread(build, ...)`` builds the runner on the process's torch thread and returns a proxy
whose methods run there (attribute reads pass through); ``TorchThread.call`` runs any function there.
A call from the torch thread itself runs inline, so runner methods may call each other.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fuseserve.errors import InvalidParameterError


class TorchThread:
    """A single long-lived thread that runs the calls handed to it, one at a time, in order."""

    def __init__(self, name: str = "fuseserve-torch"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident = self._pool.submit(threading.get_ident).result()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the torch thread (inline when already on it); its result, or its
        exception raised here."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()


_THREAD: TorchThread | None = None
_LOCK = threading.Lock()


def torch_thread() -> TorchThread:
    """The process's torch thread (started on first use)."""
    global _THREAD
    with _LOCK:
        if _THREAD is None:
            _THREAD = TorchThread()
        return _THREAD


class OnTorchThread:
    """A proxy for a model runner: each of its methods runs on the torch thread; other attributes are
    read and written through. ``target`` is the runner itself."""

    def __init__(self, target: Any, thread: TorchThread):
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "_thread", thread)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.target, name)
        if inspect.ismethod(value):
            thread = self._thread
            return lambda *args, **kwargs: thread.call(value, *args, **kwargs)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.target, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.target, name)

    def on_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the torch thread (e.g. a profiler driving this runner)."""
        return self._thread.call(fn, *args, **kwargs)


def on_torch_thread(build: Callable[..., Any], *args: Any, **kwargs: Any) -> OnTorchThread:
    """``build(*args, **kwargs)`` run on the torch thread, its result wrapped in ``OnTorchThread``."""
    thread = torch_thread()
    return OnTorchThread(thread.call(build, *args, **kwargs), thread)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (a container's cpuset, ``taskset``): ``os.sched_getaffinity``,
    all ``os.cpu_count()`` where that does not exist."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def bind_cpus(spec: str, threads: int) -> list[int]:
    """The CPUs the torch thread's ``threads`` intra-op threads are bound to, one each, for ``--cpu-bind
    spec``: ``none`` → ``[]``; a comma-separated list of CPU ids → its first ``threads``; ``auto`` →
    this process's allowed CPUs (``allowed_cpus``) when there are exactly ``threads`` of them
    (the worker owns them: a container's cpuset, or a local stack's share), else ``[]``.

    Raises ``InvalidParameterError`` for a list that is not ids of allowed CPUs, or has fewer than
    ``threads`` distinct ones.
    """
    if spec == "none" or not hasattr(os, "sched_getaffinity"):  # binding is Linux only
        return []
    allowed = allowed_cpus()
    if spec == "auto":
        return allowed if len(allowed) == threads else []
    if not re.fullmatch(r"[0-9]+(,[0-9]+)*", spec):
        raise InvalidParameterError("cpu_bind", spec, "auto, none or CPU ids like 0,1")
    cpus = [int(c) for c in spec.split(",")]
    if len(set(cpus[:threads])) < threads or not set(cpus) <= set(allowed):
        raise InvalidParameterError(
            "cpu_bind",
            spec,
            f"{threads} distinct ids among this process's CPUs ({','.join(map(str, allowed))})",
        )
    return cpus[:threads]


def bind_threads(cpus: list[int]) -> list[int]:
    """Bind the torch thread's intra-op threads one to each of ``cpus`` (thread 0, the torch thread
    itself, to ``cpus[0]``): run on the torch thread. Returns the CPU each runs on (-1: not bound);
    ``[]`` when there is nothing to bind or the C++ operator does not build here.

    Why: on a machine whose cores the worker's threads fill, a pass waits at every barrier for a thread
    the kernel moved or preempted; bound, each thread keeps its core and its caches
    (``benchmarks/README.md``, "Bound threads").
    """
    from fuseserve.kernels import cpu_stack

    if not cpus or not cpu_stack.available():
        return []
    return torch_thread().call(lambda: list(cpu_stack.load().bind_threads(cpus)))


def bind_torch_threads(spec: str) -> list[int]:
    """``bind_threads(bind_cpus(spec, threads))`` for the torch thread's current thread count: what
    ``fuseserve worker --cpu-bind spec`` does at start. Returns the CPUs bound (``[]``: none)."""
    import torch

    bound = bind_threads(bind_cpus(spec, torch_thread().call(torch.get_num_threads)))
    if bound:
        logging.getLogger(__name__).info("torch threads bound to CPUs %s", ",".join(map(str, bound)))
    return bound
