"""The gateway's side of the Redis streams (``fuseserve.messages``): submit, abort, read responses.

One background task reads this gateway's response stream (``responses_stream(gateway_id)``) with a
blocking XREAD and hands each ``TokenEvent`` to the asyncio queue registered for its ``seq_id``;
events of unknown sequences (finished, aborted, or another gateway's restart leftovers) are dropped.
A request registers its queues *before* it XADDs its sequences, so no event can arrive unrouted.

The same task watches the scheduler's heartbeat (``SCHEDULER_HEARTBEAT``) every ``check_s``
seconds: once the key has been missing (or Redis unreadable) for ``grace_s`` seconds, every
sequence in flight gets a 503 error event, so its request fails instead of waiting forever. The
task survives any Redis failure: it retries until Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from fuseserve.messages import (
    CONTROL,
    REQUESTS,
    SCHEDULER_GRACE_S,
    SCHEDULER_HEARTBEAT,
    SEQ_COUNTER,
    ControlMessage,
    RequestMessage,
    decode_events,
    responses_stream,
)
from fuseserve.types import FinishReason, TokenEvent

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
"""Milliseconds one XREAD waits at most for new entries (less when the heartbeat check is due)."""

RETRY_S = 0.5
"""Seconds between two attempts while Redis fails."""

NO_SCHEDULER_ERROR = {
    "message": "no scheduler is running: the request was in flight when the scheduler stopped",
    "type": "service_unavailable",
    "status": 503,
}
NO_REDIS_ERROR = {
    "message": "the gateway lost Redis while the request was in flight",
    "type": "service_unavailable",
    "status": 503,
}

TRIM_EVERY = 256
"""Entries read between two trims of the response stream (everything read is deleted)."""


class ResponseRouter:
    """Routes one gateway's token events to per-request queues; sends requests and aborts.

    redis: an ``redis.asyncio.Redis`` with ``decode_responses=True`` (submits, aborts, ids).
    gateway_id: this gateway's unique id (its response stream is ``responses_stream(gateway_id)``).
    reader: the client of the background task (blocking XREAD, heartbeat); default ``redis``. A
        client of its own keeps the task reading while requests hold every pooled connection.
    grace_s: seconds without a scheduler heartbeat before sequences in flight fail (503).
    check_s: seconds between two heartbeat checks.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        gateway_id: str,
        reader: aioredis.Redis | None = None,
        grace_s: float = SCHEDULER_GRACE_S,
        check_s: float = 0.5,
    ):
        self.redis = redis
        self.reader = reader if reader is not None else redis
        self.gateway_id = gateway_id
        self.grace_s = grace_s
        self.check_s = check_s
        self.scheduler_missing_since: float | None = None  # monotonic seconds; None: heartbeat seen
        self.stream = responses_stream(gateway_id)
        self._queues: dict[int, asyncio.Queue] = {}
        self._loras: dict[int, str] = {}  # seq_id → its LoRA adapter, while registered
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # fire-and-forget aborts, kept alive here
        self._last_id = "0-0"  # the stream is new (unique gateway id): read it from the start
        self._redis_down = False  # the last XREAD failed (logged once per outage)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read_loop(), name="gateway-responses")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        try:
            await self.redis.delete(self.stream)
        except Exception:  # Redis already gone: nothing to clean
            pass

    # ------------------------------------------------------------------ requests
    async def next_seq_ids(self, n: int) -> list[int]:
        """``n`` engine-wide unique sequence ids (one INCRBY of ``SEQ_COUNTER``)."""
        last = int(await self.redis.incrby(SEQ_COUNTER, n))
        return list(range(last - n + 1, last + 1))

    def register(self, seq_id: int, queue: asyncio.Queue, lora: str | None = None) -> None:
        """Route ``seq_id``'s events to ``queue`` (several sequences may share one queue); ``lora``:
        its LoRA adapter (``loras_in_flight``)."""
        self._queues[seq_id] = queue
        if lora is not None:
            self._loras[seq_id] = lora

    def unregister(self, seq_id: int) -> None:
        self._queues.pop(seq_id, None)
        self._loras.pop(seq_id, None)

    def loras_in_flight(self) -> set[str]:
        """The LoRA adapters of this gateway's sequences not finished yet."""
        return set(self._loras.values())

    async def submit(self, messages: list[RequestMessage]) -> None:
        """XADD the sequences to ``REQUESTS`` (one round trip)."""
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for msg in messages:
                msg.arrival = msg.arrival or now
                pipe.xadd(REQUESTS, msg.encode())
            await pipe.execute()

    def abort(self, seq_ids: list[int], reason: str = "abort") -> None:
        """Tell the scheduler to finish ``seq_ids`` now (CONTROL stream); stop routing their events.

        Runs as its own task, so it completes even when called from a cancelled request.
        """
        for sid in seq_ids:
            self.unregister(sid)
        if not seq_ids:
            return
        task = asyncio.get_running_loop().create_task(self._send_aborts(list(seq_ids), reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_aborts(self, seq_ids: list[int], reason: str) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in seq_ids:
                    pipe.xadd(CONTROL, ControlMessage("abort", sid, reason).encode())
                await pipe.execute()
        except Exception as e:
            log.warning("could not send abort for sequences %s: %s", seq_ids, e)

    # ------------------------------------------------------------------ response stream
    async def _read_loop(self) -> None:
        read_since_trim = 0
        checked_at = float("-inf")
        while True:
            if time.monotonic() - checked_at >= self.check_s:
                checked_at = time.monotonic()
                await self._check_scheduler()
            block_ms = max(1, min(READ_BLOCK_MS, int(self.check_s * 1000)))
            try:
                reply = await self.reader.xread({self.stream: self._last_id}, block=block_ms, count=512)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis restarting: retry without losing the position
                if not self._redis_down:
                    log.warning("reading %s failed (%s: %s); retrying", self.stream, type(e).__name__, e)
                self._redis_down = True
                await asyncio.sleep(RETRY_S)
                continue
            if self._redis_down:
                log.info("reading %s again", self.stream)
                self._redis_down = False
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    read_since_trim += 1
                    try:
                        events = decode_events(fields)
                    except Exception as e:
                        log.warning("undecodable response entry %s: %s", entry_id, e)
                        continue
                    self._dispatch(events)
            if read_since_trim >= TRIM_EVERY:
                read_since_trim = 0
                try:
                    await self.reader.xtrim(self.stream, minid=self._last_id, approximate=True)
                except Exception as e:
                    log.debug("trim of %s failed: %s", self.stream, e)

    async def _check_scheduler(self) -> None:
        """Track how long the heartbeat has been missing; past ``grace_s``, fail what is in flight.

        A Redis that does not answer counts as a missing heartbeat (no event can come either).
        """
        error = NO_SCHEDULER_ERROR
        try:
            alive = bool(await self.reader.exists(SCHEDULER_HEARTBEAT))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("heartbeat check failed: %s", e)
            alive, error = False, NO_REDIS_ERROR
        now = time.monotonic()
        if alive:
            if self.scheduler_missing_since is not None:
                log.info("scheduler heartbeat is back")
            self.scheduler_missing_since = None
            return
        if self.scheduler_missing_since is None:
            self.scheduler_missing_since = now
            log.warning("no scheduler heartbeat; requests in flight fail in %.1f s", self.grace_s)
        if now - self.scheduler_missing_since >= self.grace_s and self._queues:
            self.fail_all(error)

    def fail_all(self, error: dict) -> None:
        """Give every sequence in flight an ``error`` event (``{"message", "type", "status"}``)."""
        queues, self._queues = self._queues, {}
        self._loras = {}
        log.warning("failing %d sequences in flight: %s", len(queues), error["message"])
        for seq_id, queue in queues.items():
            queue.put_nowait(
                TokenEvent(
                    seq_id,
                    None,
                    FinishReason.ABORT,
                    error=error["message"],
                    error_status=int(error.get("status") or 500),
                    error_type=error.get("type"),
                )
            )

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            queue = self._queues.get(ev.seq_id)
            if queue is not None:
                queue.put_nowait(ev)
