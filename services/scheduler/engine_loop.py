"""The loop around the engine core, written once for both modes (STYLE.md, item 5).

The pipeline (``fuseserve/pipeline.py``: requests from caller threads, events to their queues) and
the scheduler service (``services/scheduler/service/scheduler_service.py``: requests from Redis, events to the
gateways' streams) are ``EnginePort``s: the same iteration calls them to receive what arrived, to
send the events of each poll, and to wait while there is nothing to run.
"""

from __future__ import annotations

from typing import Protocol

from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.types import TokenEvent

STALL_WAIT_S = 0.05
"""Longest wait while sequences wait that no worker can take yet (no plan in flight): no spinning."""


class EnginePort(Protocol):
    """One mode's I/O around the engine core.

    record_cpu: the core adds its own CPU per worker-step to its stats (False: the port measures
    its whole process itself).
    """

    record_cpu: bool

    def receive(self) -> float:
        """Apply what arrived (requests, aborts, periodic work) to the core; returns the seconds the
        loop may then block (a result, a ``core.wakeup`` or new input ends the wait sooner)."""

    def send(self, events: list[TokenEvent]) -> None:
        """Deliver the events of one poll that applied results (``core.num_completions`` > 0)."""

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for input while the core has nothing to run."""


def run_once(core: EngineCore, port: EnginePort) -> None:
    """One iteration: receive, then one poll of the core and the events sent; with nothing to run
    (no work, or no worker) the port's idle wait instead. Raises what the core or the port raise."""
    timeout = port.receive()
    if not (core.has_work and core.scheduler.slots):
        port.idle(timeout)
        return
    events = core.poll(timeout=timeout, record_cpu=port.record_cpu)
    if core.num_completions:
        port.send(events)
    elif not any(s.inflight for s in core.scheduler.slots.values()):
        core.wait(min(timeout, STALL_WAIT_S))  # work that no worker can take yet: do not spin
