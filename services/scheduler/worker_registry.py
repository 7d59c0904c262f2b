"""The one registry of a scheduler's workers: each worker's ``WorkerSlot`` (capacity, running
sequences, plans in flight, handle) by name, in registration order, and what is derived from them.
A worker's handle is held here once (``WorkerSlot.handle``); ``EngineCore.workers`` is its view."""

from __future__ import annotations

from fuseserve.errors import SchedulerError
from fuseserve.scheduler.worker_slot import WorkerSlot

NO_WINDOW = 1 << 30
"""The context window (tokens) while no worker is registered."""


class WorkerRegistry:
    """Workers by name (``slots``, registration order), the shortest context window among them
    (``max_model_len``), and the workers given work outside their own planning since the last
    dispatch (``touched``: a prompt placed there, a sequence freed there)."""

    def __init__(self) -> None:
        self.slots: dict[str, WorkerSlot] = {}
        self.max_model_len = NO_WINDOW
        self.touched: set[str] = set()

    def add(self, slot: WorkerSlot) -> None:
        """Register ``slot``. Raises ``SchedulerError`` when its name is taken."""
        if slot.name in self.slots:
            raise SchedulerError(f"worker {slot.name} is already registered")
        self.slots[slot.name] = slot
        self._changed()

    def remove(self, name: str) -> WorkerSlot | None:
        """Forget ``name``; returns its slot (None for an unknown worker)."""
        slot = self.slots.pop(name, None)
        if slot is not None:
            self._changed()
        return slot

    def _changed(self) -> None:
        self.max_model_len = min((s.max_model_len for s in self.slots.values()), default=NO_WINDOW)

    def touched_in_order(self) -> list[str]:
        """The touched workers in registration order (a set's order follows the string hash, which
        changes from process to process: plans would too)."""
        touched = self.touched
        return [n for n in self.slots if n in touched] if touched else []
