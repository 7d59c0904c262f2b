"""The gateway's side of the Redis streams (``fuseserve.messages``): submit, abort, read responses.

One background task reads this gateway's response stream (``responses_stream(gateway_id)``) with a
blocking XREAD and hands each ``TokenMessage`` to the asyncio queue registered for its ``seq_id``;
events of unknown sequences (finished, aborted, or another gateway's restart leftovers) are dropped.
A request registers its queues *before* it XADDs its sequences, so no event can arrive unrouted.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from fuseserve.messages import (
    CONTROL,
    REQUESTS,
    SEQ_COUNTER,
    ControlMessage,
    RequestMessage,
    TokenMessage,
    decode_events,
    responses_stream,
)

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
"""Milliseconds one XREAD waits for new entries (also how fast ``stop()`` is noticed)."""

TRIM_EVERY = 256
"""Entries read between two trims of the response stream (everything read is deleted)."""


class ResponseRouter:
    """Routes one gateway's token events to per-request queues; sends requests and aborts.

    redis: an ``redis.asyncio.Redis`` with ``decode_responses=True``.
    gateway_id: this gateway's unique id (its response stream is ``responses_stream(gateway_id)``).
    """

    def __init__(self, redis: aioredis.Redis, gateway_id: str):
        self.redis = redis
        self.gateway_id = gateway_id
        self.stream = responses_stream(gateway_id)
        self._queues: dict[int, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # fire-and-forget aborts, kept alive here
        self._last_id = "0-0"  # the stream is new (unique gateway id): read it from the start

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
    async def next_seq_id(self) -> int:
        """An engine-wide unique sequence id (INCR ``SEQ_COUNTER``)."""
        return int(await self.redis.incr(SEQ_COUNTER))

    def register(self, seq_id: int, queue: asyncio.Queue) -> None:
        """Route ``seq_id``'s events to ``queue`` (several sequences may share one queue)."""
        self._queues[seq_id] = queue

    def unregister(self, seq_id: int) -> None:
        self._queues.pop(seq_id, None)

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
        while True:
            try:
                reply = await self.redis.xread({self.stream: self._last_id}, block=READ_BLOCK_MS, count=512)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis restarting: retry without losing the position
                log.warning("reading %s failed (%s); retrying", self.stream, e)
                await asyncio.sleep(0.5)
                continue
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
                    await self.redis.xtrim(self.stream, minid=self._last_id, approximate=True)
                except Exception as e:
                    log.debug("trim of %s failed: %s", self.stream, e)

    def _dispatch(self, events: list[TokenMessage]) -> None:
        for ev in events:
            queue = self._queues.get(ev.seq_id)
            if queue is not None:
                queue.put_nowait(ev)
