"""One engine step over any transport: schedule → workers run their plans → postprocess.

The pipeline plugs in-process model runners in; the scheduler service plugs gRPC clients in
(STYLE 5). A worker whose step raises ``WorkerLostError`` is removed and its sequences recompute
elsewhere; any other failure of a step fails only the sequences of that plan.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from fuseserve.errors import WorkerLostError
from fuseserve.scheduler.scheduler import Scheduler, TokenEvent
from fuseserve.types import StepPlan, StepResult

log = logging.getLogger(__name__)


class WorkerHandle(Protocol):
    """What the loop needs of a worker: run a plan, return the sampled tokens."""

    def step(self, plan: StepPlan) -> StepResult: ...


class EngineLoop:
    """Drives a ``Scheduler`` and its workers one step at a time (single-threaded owner of the scheduler)."""

    def __init__(self, scheduler: Scheduler, workers: dict[str, WorkerHandle]):
        self.scheduler = scheduler
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(workers)), thread_name_prefix="step")
        self.num_steps = 0
        self.last_plans: dict[str, StepPlan] = {}
        self.last_forward_seconds: dict[str, float] = {}  # per worker, as the worker reported it

    def add_worker(self, name: str, handle: WorkerHandle) -> None:
        self.workers[name] = handle
        if self._pool._max_workers < len(self.workers):
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix="step")

    def step(self) -> list[TokenEvent]:
        """Schedule, run every worker's plan concurrently, postprocess. Returns the token events."""
        plans = self.scheduler.schedule()
        self.last_plans = plans
        self.last_forward_seconds = {}
        if not plans:
            return []
        if len(plans) == 1:
            ((name, plan),) = plans.items()
            futures = {name: None}
            results = {name: self._run(name, plan)}
        else:
            futures = {name: self._pool.submit(self._run, name, plan) for name, plan in plans.items()}
            results = {name: f.result() for name, f in futures.items()}
        events: list[TokenEvent] = []
        for name, result in results.items():
            if isinstance(result, WorkerLostError):
                log.error("worker %s lost (%s); resuming its sequences elsewhere", name, result)
                self.scheduler.remove_worker(name)
                self.workers.pop(name, None)
                continue
            if isinstance(result, Exception):  # the plan failed, the worker lives: fail those sequences
                log.error("step on worker %s failed: %s: %s", name, type(result).__name__, result)
                events.extend(self.scheduler.fail_plan(name, f"{type(result).__name__}: {result}"))
                continue
            self.last_forward_seconds[name] = result.forward_seconds
            events.extend(self.scheduler.postprocess(name, result))
        self.num_steps += 1
        return events

    def _run(self, name: str, plan: StepPlan) -> StepResult | Exception:
        try:
            return self.workers[name].step(plan)
        except Exception as e:  # a lost worker must not take the loop down
            return e

    def close(self) -> None:
        self._pool.shutdown(wait=False)
