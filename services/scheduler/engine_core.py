"""The engine core: the scheduler and the one registry of workers, each worker stepped on its own.

The pipeline (``fuseserve/pipeline.py``) and the scheduler service (``services/scheduler/service/scheduler_service.py``)
are I/O adapters around one ``EngineCore``: they add requests and workers, call ``poll`` and deliver
the token events it returns (to in-process queues, or to Redis streams).

Each worker has a lane: plans go out in step order and results come back into one completion
queue. When a worker's result arrives it is postprocessed and that worker gets its next plan at once,
so a slow, stalled or lost worker never delays another. With ``overlap`` a worker holds up to two
plans (the one running and the next one, built while it runs), so it never waits for the round trip
through the scheduler; ``fuseserve.scheduler.scheduler`` explains how tokens not known yet are planned
and how a stop learned one pass late is dropped.

A worker handle either runs a plan (``step(plan) -> StepResult``, called from the lane's own thread,
or inline for deterministic tests) or sends it ahead (``send(plan, on_result)``, the gRPC client,
which calls back with the result), in which case the worker itself runs plans in ``step_id`` order.
Each handle is held once, by the worker's ``WorkerSlot`` in the scheduler's ``WorkerRegistry``; a lane
is given it with each plan. A worker dropped as lost keeps its handle in ``EngineCore.lost`` until its
owner takes it to close (``take_lost``). A draining worker whose handle can ``migrate`` gets no plan:
once none of its plans is in flight its decoding sequences move to other workers with their K/V
(``fuseserve.scheduler.migration``); the answers come back like results and are applied in ``poll``.
With ``migration="balance"`` each ``poll`` may also plan a rebalancing round
(``Migrations.rebalance``), carried out the same way.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Protocol

from fuseserve.config import EngineConfig
from fuseserve.errors import WorkerLostError
from fuseserve.scheduler.core_stats import CoreStats, SchedulerStats, WorkerStats
from fuseserve.scheduler.migration import MigrationOrder, MigrationResult
from fuseserve.scheduler.scheduler import Scheduler, TokenEvent
from fuseserve.scheduler.sequence import FinishReason, Sequence
from fuseserve.scheduler.worker_lane import WorkerLane
from fuseserve.scheduler.worker_slot import MigrationPhase
from fuseserve.types import StepPlan, StepResult

log = logging.getLogger(__name__)

_WAKE = object()


class WorkerHandle(Protocol):
    """What the core needs of a worker: run a plan, return the sampled tokens (may raise
    ``WorkerLostError`` when the worker is gone, anything else when it rejected the plan)."""

    def step(self, plan: StepPlan) -> StepResult: ...


def _num_passes(result: StepResult | Exception) -> int:
    """Worker-steps a result stands for: the passes a multi-pass plan ran, else one."""
    return max(1, getattr(result, "num_passes", 1))


class EngineCore:
    """The ``Scheduler`` plus the workers it plans for; single-threaded owner of both.

    Args:
        config: engine configuration (token budget, policy, overlap, ...).
        eos_token_ids: the model's EOS ids.
        overlap: overrides ``config.overlap`` when given.
        waiter: how ``poll`` waits for results when the handles' callbacks come on the polling thread
            itself (``wait(timeout)`` runs their I/O until ``wake()``; the scheduler service passes its
            driven ``grpc_worker.IOLoop``). None: block on the completion queue (results from other
            threads).
    """

    def __init__(
        self, config: EngineConfig, eos_token_ids: list[int], overlap: bool | None = None, waiter=None
    ):
        self.scheduler = Scheduler(config, eos_token_ids)
        self.waiter = waiter
        overlap = config.overlap if overlap is None else overlap
        self.overlap = overlap
        self.depth = 2 if overlap else 1
        self.stats = CoreStats()
        self._num_idle_reported = 0  # idle times ``make_stats`` has returned so far
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._migrated: queue.SimpleQueue = queue.SimpleQueue()  # (order, answer) of KV migrations
        self._lanes: dict[str, WorkerLane] = {}
        self.lost: dict[str, WorkerHandle] = {}  # handles of workers dropped as lost, until ``take_lost``
        self._dispatch_all = False
        self.last_plans: dict[str, StepPlan] = {}  # plans sent by the last ``step`` / ``poll``
        self.num_completions = 0  # worker-steps applied by the last ``poll``
        # called with each batch of plans and the seconds ``schedule_workers`` took to build them
        self.on_plans: Callable[[dict[str, StepPlan], float], None] | None = None

    # ----- registry -----
    @property
    def workers(self) -> dict[str, object]:
        """Worker name → handle (read-only view of the registry)."""
        return {name: slot.handle for name, slot in self.scheduler.slots.items()}

    def add_worker(
        self,
        name: str,
        handle,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_budget: int | None = None,
        threaded: bool = True,
        latency_prior=None,
        lora_adapters: set[str] | None = None,
        device: str | None = None,
    ) -> None:
        """Register a worker (the other keywords: ``Scheduler.add_worker``). ``threaded=False`` runs its
        plans inline in ``step``/``poll`` (tests). Raises ``SchedulerError`` when no token budget is
        known or the name is taken."""
        capacity = (num_blocks, block_size, max_model_len, token_budget)
        self.scheduler.add_worker(name, *capacity, handle, latency_prior, lora_adapters, device)
        self._lanes[name] = WorkerLane(name, hasattr(handle, "send"), self._done, threaded, self.waiter)
        self._dispatch_all = True

    def remove_worker(self, name: str) -> list[Sequence]:
        """Forget a worker; its sequences recompute elsewhere. Results still on their way are dropped."""
        lane = self._lanes.pop(name, None)
        if lane is not None:
            lane.close()
        self._dispatch_all = True
        return self.scheduler.remove_worker(name)

    def take_lost(self) -> dict[str, WorkerHandle]:
        """The workers dropped as lost (``WorkerLostError``) since the last call, name → handle, for
        their owner to close (read and reset; the registry no longer holds them)."""
        lost, self.lost = self.lost, {}
        return lost

    def drain_worker(self, name: str) -> bool:
        """Place no new sequence on ``name`` (it is stopping); its running sequences go on to the end.

        Sequences it loses later (preempted, or the worker gone at its deadline: ``remove_worker``)
        recompute on other workers. Returns True when the worker was not draining yet; False for an
        unknown worker or one already draining.
        """
        slot = self.scheduler.slots.get(name)
        if slot is None or slot.draining:
            return False
        slot.draining = True
        log.info("worker %s is draining: %d sequences finish there, none is added", name, len(slot.running))
        return True

    # ----- requests -----
    def add_request(self, seq: Sequence) -> None:
        """Queue a sequence. Raises ``ContextLengthExceededError`` / ``InvalidRequestError``."""
        self.scheduler.add(seq)
        self._dispatch_all = True

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Finish a sequence now; its blocks are freed with its worker's next plan."""
        return self.scheduler.abort(seq_id, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def wakeup(self) -> None:
        """Make a ``poll`` blocked in another thread return (new requests or commands arrived)."""
        self._done.put(_WAKE)
        if self.waiter is not None:
            self.waiter.wake()

    def wait(self, timeout: float) -> None:
        """Idle wait of an adapter with a ``waiter``: run the handles' I/O up to ``timeout`` seconds,
        until a result or ``wakeup`` (None waiter: return at once)."""
        if self.waiter is not None:
            self.waiter.wait(timeout)

    # ----- stats -----
    def make_stats(self) -> SchedulerStats:
        """The engine's stats record: queue and workers now, totals, and the events and worker idle
        times since the previous call (read and reset: each is returned once)."""
        sched = self.scheduler
        workers = {
            name: WorkerStats(s.num_admitted, len(s.running), s.account.num_free, s.account.num_blocks)
            for name, s in sched.slots.items()
        }
        stats = self.stats
        new_idle = stats.idle_s.last(stats.num_idle - self._num_idle_reported)
        self._num_idle_reported = stats.num_idle
        new = sched.make_stats()
        return SchedulerStats(
            len(sched.waiting),
            sched.num_running,
            workers,
            stats.num_worker_steps,
            sched.num_surplus_tokens,
            new,
            new_idle,
        )

    # ----- stepping -----
    def poll(self, timeout: float | None = None, record_cpu: bool = True) -> list[TokenEvent]:
        """Send plans to workers with room, wait up to ``timeout`` seconds for results, apply every
        result that has arrived (each worker's next plan goes out as soon as its result is applied).

        Returns the token events of the applied results (empty on timeout or ``wakeup``).
        ``record_cpu``: add this call's CPU per worker-step to ``stats`` (off when the caller
        measures its whole process).
        """
        t0 = time.thread_time()  # CPU of this thread only: time blocked waiting is not counted
        self.last_plans = {}
        self.num_completions = 0
        self._apply_migrations()
        self.scheduler.migrations.rebalance(time.monotonic())
        self._dispatch()
        events: list[TokenEvent] = []
        if not any(s.inflight for s in self.scheduler.slots.values()):
            return events
        try:
            if self.waiter is None:
                item = self._done.get(timeout=timeout)
            else:  # the handles' I/O runs here: at least once, so the plans just sent go out
                self.waiter.wait(0.0 if not self._done.empty() else timeout)
                item = self._done.get_nowait()
        except queue.Empty:
            return events
        while True:
            lane = self._arrived(item)
            if lane is not None:
                self._apply_ready(lane, None, events)
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                break
        self._dispatch()
        if self.waiter is not None and self.last_plans:
            self.waiter.wait(0.0)  # the plans just sent go out now, not after the caller's publishing
        if record_cpu:
            self.stats.add_cpu(time.thread_time() - t0, self.num_completions)
        return events

    def step(self) -> list[TokenEvent]:
        """One round for tests and simple drivers: send plans to every worker with room, then wait for
        and apply the oldest plan in flight of each worker (results of later plans stay queued)."""
        self.last_plans = {}
        self.num_completions = 0
        self._apply_migrations()
        self.scheduler.migrations.rebalance(time.monotonic())
        self._dispatch()
        want = {name for name, slot in self.scheduler.slots.items() if slot.inflight}
        events: list[TokenEvent] = []
        while want:
            for name in list(want):
                lane = self._lanes.get(name)
                if lane is None or self._apply_ready(lane, 1, events):
                    want.discard(name)
            if want:
                while self.waiter is not None and self._done.empty():
                    self.waiter.wait(1.0)
                self._arrived(self._done.get())
        return events

    def _arrived(self, item) -> WorkerLane | None:
        """Keep a result that came back; returns its lane, or None (a wakeup, a removed worker's answer)."""
        if item is _WAKE:
            return None
        lane, step_id, result = item
        if self._lanes.get(lane.name) is not lane:
            return None
        lane.results[step_id] = result
        return lane

    def _apply_ready(self, lane: WorkerLane, limit: int | None, out: list[TokenEvent]) -> bool:
        """Apply ``lane``'s arrived results in step order, at most ``limit``; True when one was applied.

        Without a limit (``poll``) the worker's next plan goes out right after each result.
        """
        applied = 0
        while limit is None or applied < limit:
            slot = self.scheduler.slots.get(lane.name)
            if slot is None or not slot.inflight:
                break
            result = lane.results.pop(slot.inflight[0].plan.step_id, None)
            if result is None:
                break
            out.extend(self._apply(lane, result))
            applied += 1
            self.num_completions += _num_passes(result)
            if limit is None:
                self._dispatch_worker(lane.name)
            else:  # ``step``: at the start of the next round
                self.scheduler.touched.add(lane.name)
        return applied > 0

    def _apply(self, lane: WorkerLane, result: StepResult | Exception) -> list[TokenEvent]:
        name = lane.name
        if isinstance(result, Exception):
            if isinstance(result, WorkerLostError):
                log.error("worker %s lost (%s); resuming its sequences elsewhere", name, result)
                self.lost[name] = self.scheduler.slots[name].handle
                self.remove_worker(name)
                return []
            # the plan failed, the worker lives: fail those sequences
            log.error("step on worker %s failed: %s: %s", name, type(result).__name__, result)
            return self.scheduler.fail_plan(name, f"{type(result).__name__}: {result}")
        self.stats.num_worker_steps += _num_passes(result)
        idle = getattr(result, "idle_seconds", None)
        if idle is not None and idle >= 0:
            self.stats.idle_s.append(idle)
            self.stats.num_idle += 1
        return self.scheduler.postprocess(name, result)

    def _dispatch(self) -> None:
        """Send plans to every worker that may need one (new requests, work placed on it, frees)."""
        registry = self.scheduler.registry
        names = list(registry.slots) if self._dispatch_all else registry.touched_in_order()
        self._dispatch_all = False
        while names:
            registry.touched.clear()
            self._dispatch_workers(names)
            names = registry.touched_in_order()  # planning placed prompts on other workers

    def _dispatch_worker(self, name: str) -> None:
        self._dispatch_workers([name])

    def _dispatch_workers(self, names: list[str]) -> None:
        """Fill each named worker's lane up to ``depth`` plans, planning the workers together; a
        draining worker that migrates starts its round instead, once nothing of it is in flight."""
        slots = self.scheduler.slots
        lanes = self._lanes
        wanted = self.scheduler.migrations.wanted
        while True:
            ready = []
            for n in names:
                s = slots.get(n)
                if n not in lanes or s is None or len(s.inflight) >= self.depth:
                    continue
                if not wanted(s):
                    ready.append(n)
                elif not s.inflight and s.migration is MigrationPhase.NONE:
                    self._start_migration(n)
            if not ready:
                return
            started = time.perf_counter()
            plans = self.scheduler.schedule_workers(ready)
            if self.on_plans is not None and plans:
                self.on_plans(plans, time.perf_counter() - started)
            for name, plan in plans.items():
                self.last_plans[name] = plan
                lanes[name].submit(slots[name].handle, plan)
            names = list(plans)

    # ----- KV migration -----
    def _start_migration(self, name: str) -> None:
        """Plan ``name``'s round of moves and send each destination's to ``name``'s handle."""
        slots = self.scheduler.slots
        source = slots[name].handle
        for order in self.scheduler.migrations.start(name):
            moves = [(seq.seq_id, ids, shared) for seq, ids, shared in order.moves]
            log.info("migrating %d sequences from %s to %s", len(moves), name, order.dest)
            source.migrate(slots[order.dest].handle, moves, lambda res, o=order: self._migration_done(o, res))

    def _migration_done(self, order: MigrationOrder, result: MigrationResult | Exception) -> None:
        """A source worker's answer (any thread): applied by the next ``poll``."""
        self._migrated.put((order, result))
        self._done.put(_WAKE)
        if self.waiter is not None:
            self.waiter.wake()

    def _apply_migrations(self) -> None:
        while True:
            try:
                order, result = self._migrated.get_nowait()
            except queue.Empty:
                return
            if isinstance(result, Exception):
                log.error("migration from %s to %s failed: %s", order.source, order.dest, result)
            else:
                log.info(
                    "migrated %d of %d sequences from %s to %s: %.1f MB in %.3f s%s",
                    len(result.moved),
                    len(order.moves),
                    order.source,
                    order.dest,
                    result.num_bytes / 1e6,
                    result.seconds,
                    f" ({result.error})" if result.error else "",
                )
            self.scheduler.migrations.done(order, result)
            self._dispatch_all = True

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
