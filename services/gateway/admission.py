"""May a new request enter? A live scheduler and workers (503 without), the queue (429 when full).

Every fact comes from Redis: the scheduler's heartbeat key ``SCHEDULER_HEARTBEAT`` (it expires
``SCHEDULER_TTL_S`` seconds after the scheduler's last beat), worker records ``fuseserve:worker:*``
(they expire without a heartbeat) and the schedulers' stats records (``{"waiting", "running",
"time"}``, each scheduler its own, written each second; their ``waiting`` counts are added up). They are read at most once per ``cache_s`` seconds, and one read at a time:
concurrent callers share the refresh in flight, so a burst of requests costs Redis one refresh.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from fuseserve.errors import NoWorkerError, QueueFullError
from fuseserve.gateway.http_errors import SchedulerUnavailableError
from fuseserve.messages import (
    SCHEDULER_HEARTBEAT,
    SCHEDULER_STATS_PATTERN,
    WORKER_PREFIX,
    WorkerRecord,
    merge_scheduler_stats,
)


@dataclass
class Snapshot:
    """What admission knows, read at ``taken_at`` (``time.monotonic()`` seconds).

    scheduler_alive: the scheduler's heartbeat key exists. num_workers: live worker records.
    waiting: sequences waiting in the scheduler (None: unknown or stale).
    """

    scheduler_alive: bool
    num_workers: int
    waiting: int | None
    taken_at: float


class Admission:
    """Reads scheduler, workers and queue depth from Redis; ``check()`` raises to refuse a request.

    max_queue: refuse (429) while the scheduler has at least this many sequences waiting.
    cache_s: seconds a snapshot is reused (0: a new read for every check that finds none in flight).
    """

    def __init__(self, redis: aioredis.Redis, max_queue: int, cache_s: float = 0.25):
        self.redis = redis
        self.max_queue = max_queue
        self.cache_s = cache_s
        self._snapshot: Snapshot | None = None
        self._refresh: asyncio.Future[Snapshot] | None = None  # the read in flight, shared

    async def snapshot(self, fresh: bool = False) -> Snapshot:
        """The current snapshot; ``fresh``: not a cached one (a read in flight is still shared).

        Raises ``redis.exceptions.RedisError`` (ConnectionError, TimeoutError) when Redis fails;
        every caller sharing that read gets the error.
        """
        snap = self._snapshot
        if not fresh and snap is not None and time.monotonic() - snap.taken_at < self.cache_s:
            return snap
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._read())
            self._refresh.add_done_callback(self._refresh_done)
        # shield: one cancelled caller (client gone) must not cancel the read the others wait on
        return await asyncio.shield(self._refresh)

    def _refresh_done(self, fut: asyncio.Future[Snapshot]) -> None:
        self._refresh = None
        if not fut.cancelled() and fut.exception() is None:
            self._snapshot = fut.result()

    async def _read(self) -> Snapshot:
        now = time.monotonic()
        num_workers = len(await self._worker_keys())
        stats_keys = await self._stats_keys()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(SCHEDULER_HEARTBEAT)
            if stats_keys:
                pipe.mget(stats_keys)
            alive, *raws = await pipe.execute()
        # stale records (a dead scheduler's) are skipped: they must not lock us out
        stats = merge_scheduler_stats(raws[0] if raws else [], time.time())
        waiting = stats["waiting"] if stats else None
        return Snapshot(bool(alive), num_workers, waiting, now)

    async def scheduler_stats(self) -> dict:
        """``messages.merge_scheduler_stats`` of the schedulers' records, read now (not cached).

        Raises ``redis.exceptions.RedisError`` when Redis fails.
        """
        keys = await self._stats_keys()
        return merge_scheduler_stats(await self.redis.mget(keys) if keys else [], time.time())

    async def _stats_keys(self) -> list:
        return [k async for k in self.redis.scan_iter(match=SCHEDULER_STATS_PATTERN, count=1000)]

    async def worker_records(self) -> list[WorkerRecord]:
        """The live workers' records (``fuseserve:worker:*``; one that expires meanwhile is skipped).

        Raises ``redis.exceptions.RedisError`` when Redis fails.
        """
        keys = await self._worker_keys()
        raws = await self.redis.mget(keys) if keys else []
        return [WorkerRecord.decode(raw) for raw in raws if raw]

    async def _worker_keys(self) -> list:
        """The keys of the live workers' records (``fuseserve:worker:*``)."""
        return [k async for k in self.redis.scan_iter(match=f"{WORKER_PREFIX}*", count=1000)]

    async def check(self) -> Snapshot:
        """Raise ``SchedulerUnavailableError`` (503) without a scheduler heartbeat,
        ``NoWorkerError`` (503) without a live worker, ``QueueFullError`` (429) when the queue is full.
        """
        snap = await self.snapshot()
        if not snap.scheduler_alive:
            raise SchedulerUnavailableError()
        if snap.num_workers == 0:
            raise NoWorkerError("no worker is available: no live worker record in Redis")
        if snap.waiting is not None and snap.waiting >= self.max_queue:
            raise QueueFullError(
                f"too many requests waiting: {snap.waiting} sequences queued (limit {self.max_queue})",
                retry_after=1.0,
            )
        return snap
