"""Pipelines still open when the interpreter exits are closed first (``fuseserve.pipeline`` adds each
to ``LIVE``): their engine threads must stop before torch is torn down."""

from __future__ import annotations

import atexit
import threading
import weakref

LIVE: weakref.WeakSet = weakref.WeakSet()  # pipelines not closed yet


def close_live_pipelines() -> None:
    """Stop engine threads before the interpreter tears torch down (a thread killed inside a torch op
    aborts the process)."""
    for pipe in list(LIVE):
        pipe.close()


def _register_exit_hook() -> None:
    """Close live pipelines at exit before ``concurrent.futures`` refuses new work.

    ``concurrent.futures`` shuts its executors from ``threading``'s exit hooks, which run before
    ``atexit``'s: an engine thread still stepping then fails with "cannot schedule new futures after
    interpreter shutdown". ``threading``'s hooks run last-registered first, so this one, registered
    after ``concurrent.futures.thread`` is imported, runs before that shutdown. ``atexit`` as well,
    for interpreters without the hook (``close`` is idempotent).
    """
    import concurrent.futures.thread  # noqa: F401 (its hook registered first, so it runs after ours)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(close_live_pipelines)
    atexit.register(close_live_pipelines)


_register_exit_hook()
