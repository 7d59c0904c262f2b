"""A worker's lane in the engine core: its plans out in step order, its results into the core's one
completion queue (``engine_core.EngineCore``)."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

from fuseserve.types import StepPlan, StepResult


class WorkerLane:
    """Carries one worker's plans out in order and its results into the core's completion queue.

    A handle with ``send(plan, on_result)`` (the gRPC client) takes the plan and calls back from its
    own thread; one with only ``step(plan)`` runs on the lane's thread, or inline when not threaded.
    The lane keeps no handle: ``submit`` is given the registry's with each plan.
    """

    def __init__(self, name: str, sends: bool, done: queue.SimpleQueue, threaded: bool, waiter=None):
        self.name = name
        self._sends = sends  # the worker's handle has ``send``
        self._done = done
        self._waiter = waiter
        self.results: dict[int, StepResult | Exception] = {}  # arrived, waiting for older plans
        self._pool = None
        if not sends and threaded:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{name}")

    def submit(self, handle, plan: StepPlan) -> None:
        """Send ``plan`` through ``handle`` (the worker's, from the registry)."""
        if self._sends:
            handle.send(plan, self._put)
        elif self._pool is not None:
            self._pool.submit(self._run, handle, plan)
        else:
            self._run(handle, plan)

    def _run(self, handle, plan: StepPlan) -> None:
        try:
            result: StepResult | Exception = handle.step(plan)
        except Exception as e:  # a lost worker must not take the core down
            result = e
        self._done.put((self, plan.step_id, result))

    def _put(self, step_id: int, result: StepResult | Exception) -> None:
        self._done.put((self, step_id, result))
        if self._waiter is not None:
            self._waiter.wake()

    def close(self) -> None:
        """Drop plans not started; wait for the one running (a thread must not die inside a pass)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
