"""The engine core's stats: scheduler CPU and worker idle time per worker-step over a window
(``CoreStats``), the scheduler's event counters (``SchedulerCounters``) and the typed record an adapter
reads them through (``SchedulerStats``, from ``EngineCore.make_stats``).

``EngineCore.stats`` is a ``CoreStats``; the scheduler service writes its p50 / p99 into its stats
record and Prometheus histograms (``services/scheduler/service/scheduler_service.py``). Counters cross to the service
read and reset (vLLM's ``make_prefix_cache_stats``): each ``make_stats`` returns the events since the
previous one, so no reader diffs another object's counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

STATS_WINDOW = 20_000  # worker-steps kept in ``CoreStats``


class SampleWindow:
    """The last ``size`` samples of one measurement (floats, e.g. seconds), oldest overwritten first.

    A numpy ring buffer: ``append`` is O(1), and ``p50_p99_ms`` partitions the window in place of
    sorting a copy of it (a sorted 20,000-entry deque cost ~4 ms per stats write on the 2-vCPU dev
    machine; this ~0.3 ms), and is computed again only after new samples arrived.
    """

    def __init__(self, size: int = STATS_WINDOW):
        self._buf = np.zeros(size)
        self._size = size
        self.num_added = 0  # samples appended so far (the window keeps the last ``size``)
        self._cached: tuple[int, tuple[float, float]] | None = None

    def __len__(self) -> int:
        return min(self.num_added, self._size)

    def append(self, value: float) -> None:
        self._buf[self.num_added % self._size] = value
        self.num_added += 1

    def add(self, value: float, count: int) -> None:
        """Append ``value`` ``count`` times."""
        if count == 1:
            self._buf[self.num_added % self._size] = value
        elif count <= 0:
            return
        elif count >= self._size:
            self._buf[:] = value
        else:
            start = self.num_added % self._size
            first = min(count, self._size - start)
            self._buf[start : start + first] = value
            self._buf[: count - first] = value
        self.num_added += count

    def last(self, k: int) -> list[float]:
        """The newest ``k`` samples (at most ``len(self)``), newest first."""
        k = min(k, len(self))
        end, size, item = self.num_added, self._size, self._buf.item
        return [item((end - i) % size) for i in range(1, k + 1)]

    def values(self) -> np.ndarray:
        """The samples in the window (a copy, in no particular order) ``[len(self)]``."""
        return self._buf[: len(self)].copy()

    def p50_p99_ms(self) -> tuple[float, float]:
        """``(median, 99th percentile)`` of the window times 1000 (seconds → ms); NaN when empty.
        The median of an even count is the mean of the two middle samples; the 99th percentile is
        the sample at rank ``int(0.99 * n)`` of the sorted window."""
        n = len(self)
        if not n:
            return (float("nan"), float("nan"))
        if self._cached is not None and self._cached[0] == self.num_added:
            return self._cached[1]
        ranks = sorted({(n - 1) // 2, n // 2, min(n - 1, int(0.99 * n))})
        part = np.partition(self._buf[:n], ranks)
        p50 = (part[(n - 1) // 2] + part[n // 2]) / 2
        out = (float(p50) * 1e3, float(part[min(n - 1, int(0.99 * n))]) * 1e3)
        self._cached = (self.num_added, out)
        return out


@dataclass
class CoreStats:
    """Measured costs over the last ``STATS_WINDOW`` worker-steps.

    cpu_s: scheduler CPU seconds per worker-step (postprocess + next plan + hand-off, measured by
        ``poll`` on its own thread; an adapter that measures its whole process instead records with
        ``add_cpu``). idle_s: seconds a worker sat idle before a pass, as it reported
        (``StepResult.idle_seconds``).
    """

    cpu_s: SampleWindow = field(default_factory=SampleWindow)
    idle_s: SampleWindow = field(default_factory=SampleWindow)
    num_worker_steps: int = 0
    num_idle: int = 0  # idle times recorded so far (``idle_s`` keeps the last ones)

    def add_cpu(self, seconds: float, num_steps: int) -> None:
        """Spread ``seconds`` of CPU over ``num_steps`` worker-steps."""
        if num_steps > 0:
            self.cpu_s.add(seconds / num_steps, num_steps)

    def cpu_per_step_ms(self) -> tuple[float, float]:
        """Scheduler CPU per worker-step in milliseconds, ``(p50, p99)``."""
        return self.cpu_s.p50_p99_ms()

    def idle_ms(self) -> tuple[float, float]:
        """Worker idle time between passes in milliseconds, ``(p50, p99)``."""
        return self.idle_s.p50_p99_ms()


@dataclass
class SchedulerCounters:
    """Scheduler events, counted where they happen (``Scheduler.counters``); each is a count since
    the previous ``Scheduler.make_stats``, or a total (``Scheduler.totals``).

    num_preemptions: sequences preempted (recomputed later). num_forced_preemptions: of those, past
    ``max_preemptions`` to break a KV-cache deadlock. num_surplus_tokens: tokens sampled past a stop
    learned one pass late, dropped. num_prefix_queries: prompt tokens looked up in a prefix cache at
    admission; num_prefix_hits: of those, tokens found cached (not computed again).
    num_recomputed_tokens: computed tokens whose K/V was given up (a sequence preempted, moved off a
    lost or draining worker, or its plan failed) and must be computed again. num_migrated: sequences
    moved to another worker with their K/V (``migration.py``); num_migrated_bytes: the K/V bytes sent.
    num_rebalanced: of the sequences migrated, those moved to even out the workers' queue delays
    (``rebalance.py``), not off a draining worker.
    """

    num_preemptions: int = 0
    num_forced_preemptions: int = 0
    num_surplus_tokens: int = 0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_recomputed_tokens: int = 0
    num_migrated: int = 0
    num_migrated_bytes: int = 0
    num_rebalanced: int = 0
    migration_seconds: float = 0.0  # wall seconds of the migrations' transfers (source to destination)

    def add(self, other: SchedulerCounters) -> None:
        """Add ``other``'s counts to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def take(self) -> SchedulerCounters:
        """A copy of these counts, which start again from 0 (read and reset, in place: the managers
        that count hold this object)."""
        out = SchedulerCounters()
        out.add(self)
        for f in fields(self):
            setattr(self, f.name, 0)
        return out


@dataclass
class WorkerStats:
    """One worker's load when the record was made: sequences admitted onto it so far (recomputes
    included), running now, and its free / total KV blocks."""

    num_admitted: int
    num_running: int
    num_free_blocks: int
    num_blocks: int


@dataclass
class SchedulerStats:
    """One read of the engine core (``EngineCore.make_stats``): its state now, totals so far, and
    what happened since the previous read.

    num_waiting / num_running: sequences queued / running on workers. workers: by worker name, in
    registration order. num_worker_steps: passes applied so far. num_surplus_tokens: the total of
    ``SchedulerCounters.num_surplus_tokens`` so far. new: the scheduler's events since the previous
    read. new_idle_s: worker idle times (seconds) reported since the previous read, newest first.
    """

    num_waiting: int
    num_running: int
    workers: dict[str, WorkerStats]
    num_worker_steps: int
    num_surplus_tokens: int
    new: SchedulerCounters
    new_idle_s: list[float]
