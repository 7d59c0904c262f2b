"""Graceful drain: what SIGTERM (and Ctrl-C) means to a worker or a scheduler process.

The first signal starts a drain with a deadline (``--drain-timeout`` seconds, default
``messages.DRAIN_TIMEOUT_S``): the process takes no new sequences and finishes, or hands back, the
ones it has (``fuseserve.worker.server.run_worker``, ``fuseserve.scheduler.service.scheduler_drain``). A second
signal, or the deadline, ends the drain at once: what is left is handed back for recompute
elsewhere. Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds`` before SIGKILL,
Docker Compose ``stop_grace_period``: both are set above the drain timeout.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)


class DrainSignal:
    """The drain state of one process, set from its signal handlers (or ``request`` in tests).

    Args:
        timeout_s: seconds from the first signal to the deadline (>= 0).

    Attributes:
        requested: set by the first signal: stop taking new work.
        now: set by a second signal: stop at once (``expired`` is then True).
        deadline: ``time.monotonic()`` of the deadline; None before the first signal.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = max(0.0, float(timeout_s))
        self.requested = threading.Event()
        self.now = threading.Event()
        self.deadline: float | None = None

    def install(self) -> DrainSignal:
        """Handle SIGTERM and SIGINT with ``request`` (call from the main thread). Returns self."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, why: str = "request") -> None:
        """Start the drain; a second call ends it at once."""
        if self.requested.is_set():
            log.warning("%s while draining: stopping now", why)
            self.now.set()
            return
        log.info("%s: draining (deadline in %.0f s)", why, self.timeout_s)
        self.deadline = time.monotonic() + self.timeout_s
        self.requested.set()

    def expired(self) -> bool:
        """True once the deadline has passed or a second signal came."""
        return self.now.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early on a second signal."""
        self.now.wait(seconds)

    def wait_requested(self, poll_s: float = 0.25) -> None:
        """Block the main thread until the first signal. It waits in ``poll_s`` slices: the kernel may
        deliver SIGTERM to any thread (gRPC's, the heartbeat's), and Python runs the handler only
        when the main thread next runs bytecode, which a wait without a timeout never does."""
        while not self.requested.wait(poll_s):
            pass
