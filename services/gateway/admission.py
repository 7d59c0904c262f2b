"""May a new request enter? Live workers (503 without one) and the scheduler's queue (429 when full).

Both facts come from Redis: worker records ``fuseserve:worker:*`` (they expire without a heartbeat)
and ``SCHEDULER_STATS`` (``{"waiting", "running", "time"}``, written each second). They are read at
most once per ``cache_s`` seconds, so a burst of requests costs Redis one round trip.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from fuseserve.errors import NoWorkerError, QueueFullError
from fuseserve.messages import SCHEDULER_STATS, WORKER_PREFIX

STATS_MAX_AGE_S = 30.0
"""Scheduler stats older than this (seconds) are ignored: a dead scheduler must not lock us out."""


@dataclass
class Snapshot:
    """num_workers: live worker records. waiting: sequences waiting in the scheduler (None: unknown)."""

    num_workers: int
    waiting: int | None
    taken_at: float


class Admission:
    """Reads workers and queue depth from Redis; ``check()`` raises when a request must be refused.

    max_queue: refuse (429) while the scheduler has at least this many sequences waiting.
    cache_s: seconds a snapshot is reused (0: read Redis on every check).
    """

    def __init__(self, redis: aioredis.Redis, max_queue: int, cache_s: float = 0.25):
        self.redis = redis
        self.max_queue = max_queue
        self.cache_s = cache_s
        self._snapshot: Snapshot | None = None

    async def snapshot(self, fresh: bool = False) -> Snapshot:
        now = time.monotonic()
        if not fresh and self._snapshot is not None and now - self._snapshot.taken_at < self.cache_s:
            return self._snapshot
        num_workers = 0
        async for _key in self.redis.scan_iter(match=f"{WORKER_PREFIX}*", count=1000):
            num_workers += 1
        waiting = None
        raw = await self.redis.get(SCHEDULER_STATS)
        if raw:
            try:
                stats = json.loads(raw)
                if time.time() - float(stats.get("time", 0)) <= STATS_MAX_AGE_S:
                    waiting = int(stats.get("waiting", 0))
            except (ValueError, TypeError, AttributeError):
                waiting = None
        self._snapshot = Snapshot(num_workers, waiting, now)
        return self._snapshot

    async def check(self) -> Snapshot:
        """Raise ``NoWorkerError`` (503) without a live worker, ``QueueFullError`` (429) when full."""
        snap = await self.snapshot()
        if snap.num_workers == 0:
            raise NoWorkerError("no worker is available: no live worker record in Redis")
        if snap.waiting is not None and snap.waiting >= self.max_queue:
            raise QueueFullError(
                f"too many requests waiting: {snap.waiting} sequences queued (limit {self.max_queue})",
                retry_after=1.0,
            )
        return snap
