"""The scheduler service's Redis I/O: reader threads in, batched writes out.

Two daemon threads block on Redis so that the service loop never polls it:

- the **request reader** reads new requests through the consumer group (``XREADGROUP ... BLOCK``),
  at most as many as the service says it has room for (``RedisInbox.set_room``), and reads again only
  after the service has taken the previous batch (pull-based: requests stay in the stream for a
  scheduler with room);
- the **control reader** follows the control stream (``XREAD ... BLOCK``: aborts).

Each hands what it read to the service through ``RedisInbox`` and calls the ``wake`` callback (the
service passes ``EngineCore.wakeup``), so a loop blocked waiting for worker results picks new work up
at once. On the way out, ``publish`` writes the token events of one poll round in one pipeline: one
``XADD`` per gateway, then the acknowledgement of finished requests.

See ``docs/architecture.md`` (the stack walk-through) for where this sits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import redis

from fuseserve import messages
from fuseserve.scheduler.scheduler import TokenEvent

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # longest a reader blocks in Redis before it looks at ``stop`` again
MAX_READ = 256  # requests read at most per XREADGROUP
RETRY_S = 1.0  # wait after a Redis error before a reader tries again
CONTROL_KEEP_S = 120.0  # control entries younger than this are kept (other schedulers may not have read them)

REQUESTS = "requests"  # inbox item kinds: (kind, entries)
CONTROL = "control"
NOGROUP = "nogroup"  # the consumer group is gone (Redis restarted empty); the service recreates it


class RedisInbox:
    """New requests and control entries read by two blocking reader threads, for the service loop.

    Items are ``(kind, entries)`` with kind ``REQUESTS`` / ``CONTROL`` (entries as redis-py returns
    them: ``[(entry_id, fields), ...]``) or ``(NOGROUP, [])``.

    Args:
        r: the Redis client (its pool gives each reader thread a connection of its own).
        consumer: this scheduler's consumer name in ``messages.SCHEDULER_GROUP``.
        wake: called after each hand-over (from a reader thread): makes the loop's wait return.
    """

    def __init__(self, r: redis.Redis, consumer: str, wake: Callable[[], None]):
        self.r = r
        self.consumer = consumer
        self._wake = wake
        self._items: deque = deque()
        self._ready = threading.Event()
        self._cond = threading.Condition()
        self._room = 0  # requests the service can take now
        self._unread = 0  # request batches handed over and not yet taken
        self._threads: list[threading.Thread] = []

    def start(self, stop: threading.Event) -> None:
        """Start both readers; they end within ``READ_BLOCK_MS`` of ``stop`` being set. The control
        reader starts at the stream's first entry (aborts sent while no scheduler ran)."""
        if self._threads:
            return
        for target, name in ((self._read_requests, "redis-requests"), (self._read_control, "redis-control")):
            t = threading.Thread(target=target, args=(stop,), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    # ----- service side -----
    def take(self) -> list[tuple[str, list]]:
        """Everything handed over since the last call (never blocks)."""
        self._ready.clear()
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until something is handed over (the idle loop's wait)."""
        self._ready.wait(timeout)

    def set_room(self, room: int, batches_taken: int = 0) -> None:
        """Tell the request reader how many requests the service can take now, after it applied
        ``batches_taken`` request batches from ``take``."""
        with self._cond:
            self._room = room
            self._unread = max(0, self._unread - batches_taken)
            self._cond.notify()

    # ----- reader threads -----
    def _hand_over(self, kind: str, entries: list) -> None:
        self._items.append((kind, entries))
        self._ready.set()
        self._wake()

    def _read(self, what: str, stop: threading.Event, read: Callable[[], list]) -> list:
        """The entries of ``read()`` (one blocking XREAD / XREADGROUP); ``[]`` after an error, which is
        logged and waited out (``RETRY_S``): a reader outlives any Redis trouble."""
        try:
            resp = read()
        except Exception as e:  # noqa: BLE001 - see above
            if isinstance(e, redis.ResponseError) and "NOGROUP" in str(e):
                self._hand_over(NOGROUP, [])
            elif not stop.is_set():
                log.warning("reading %s failed (%s); retrying", what, e)
            stop.wait(RETRY_S)
            return []
        return [e for _, batch in resp or [] for e in batch]

    def _read_requests(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._room > 0 and not self._unread, timeout=READ_BLOCK_MS / 1000)
                count = min(MAX_READ, self._room) if not self._unread else 0
            if count <= 0:
                continue
            entries = self._read(
                "requests",
                stop,
                partial(
                    self.r.xreadgroup,
                    messages.SCHEDULER_GROUP,
                    self.consumer,
                    {messages.REQUESTS: ">"},
                    count=count,
                    block=READ_BLOCK_MS,
                ),
            )
            if entries:
                with self._cond:
                    self._unread += 1
                self._hand_over(REQUESTS, entries)

    def _read_control(self, stop: threading.Event) -> None:
        last_id = "0-0"
        while not stop.is_set():
            entries = self._read(
                "the control stream",
                stop,
                partial(self.r.xread, {messages.CONTROL: last_id}, count=1000, block=READ_BLOCK_MS),
            )
            if entries:
                last_id = entries[-1][0]
                self._hand_over(CONTROL, entries)


def setup_streams(r: redis.Redis) -> None:
    """Create the request stream and the schedulers' consumer group if missing."""
    try:
        r.xgroup_create(messages.REQUESTS, messages.SCHEDULER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def trim_control(r: redis.Redis) -> None:
    """Drop control entries older than ``CONTROL_KEEP_S`` (every scheduler has read them by then)."""
    oldest_ms = int((time.time() - CONTROL_KEEP_S) * 1000)
    r.xtrim(messages.CONTROL, minid=f"{oldest_ms}-0", approximate=True)


def _error_type(status: int) -> str:
    return "service_unavailable" if status == 503 else "server_error"


def token_message(ev: TokenEvent) -> messages.TokenMessage:
    """The wire form of one token event (``fuseserve.messages.TokenMessage``)."""
    tok = ev.token
    return messages.TokenMessage(
        seq_id=ev.seq_id,
        index=ev.index,
        token_id=tok.token_id if tok else None,
        logprob=tok.logprob if tok else None,
        top_logprobs=[[t.token_id, t.logprob] for t in tok.top_logprobs] if tok and tok.top_logprobs else [],
        hidden=ev.hidden,
        prompt_logprobs=messages.prompt_logprobs_to_wire(ev.prompt_logprobs),
        finish_reason=ev.finish_reason.value if ev.finish_reason else None,
        cached_tokens=ev.cached_tokens,
        error=None
        if ev.error is None
        else {"message": ev.error, "type": _error_type(ev.error_status), "status": ev.error_status},
    )


def publish(
    r: redis.Redis, by_gateway: dict[str, list[messages.TokenMessage]], ack_ids: list[str] = ()
) -> None:
    """One round trip: one batched ``XADD`` per gateway, then acknowledge (and delete) the request
    entries ``ack_ids`` of finished sequences (after their last token is written)."""
    if not by_gateway and not ack_ids:
        return
    pipe = r.pipeline(transaction=False)
    for gw, evs in by_gateway.items():
        pipe.xadd(
            messages.responses_stream(gw),
            messages.encode_events(evs),
            maxlen=messages.RESPONSE_STREAM_MAXLEN,
            approximate=True,
        )
    if ack_ids:
        pipe.xack(messages.REQUESTS, messages.SCHEDULER_GROUP, *ack_ids)
        pipe.xdel(messages.REQUESTS, *ack_ids)
    pipe.execute()
