"""The scheduler service's Redis I/O: reader threads in, batched writes out.

Two daemon threads block on Redis so that the service loop never polls it:

- the **request reader** reads new requests through the consumer group (``XREADGROUP ... BLOCK``),
  at most as many as the service says it has room for (``RedisInbox.set_room``), and reads again only
  after the service has taken the previous batch (pull-based: requests stay in the stream for a
  scheduler with room);
- the **control reader** follows the control stream (``XREAD ... BLOCK``: aborts).

Each hands what it read to the service through ``RedisInbox`` and calls the ``wake`` callback (the
service passes ``EngineCore.wakeup``), so a loop blocked waiting for worker results picks new work up
at once. On the way out, ``LoopConnection.publish`` writes the token events of one poll round in one
write on the loop's own connection: one ``XADD`` per gateway, then the acknowledgement of finished
requests; their replies are read with the next round's (pipelined: the loop never waits for them).

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
from fuseserve.scheduler.service import request_claims

log = logging.getLogger(__name__)

#: longest a reader blocks in Redis before it looks at ``stop`` again (new entries end the block at
#: once). Each wakeup costs ~0.4 ms of CPU on the dev machine; under redis-py's default 5 s socket timeout.
READ_BLOCK_MS = 4000
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
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

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


class LoopConnection:
    """A thread's own Redis connection, several commands per round trip: the service loop's (its
    writes: token events, acknowledgements; its periodic reads) and the heartbeat thread's.

    A redis-py ``Pipeline`` per poll round cost ~0.12 ms of CPU on the 2-vCPU dev machine, a plain
    ``execute_command`` ~0.07 ms (connection pool, retry wrapper, reply callbacks); commands sent on
    a held connection and their replies read back cost ~0.03 ms. A round trip after the loop slept
    costs ~0.5 ms there, so the periodic tasks due together share one. Use from one thread only.

    Args:
        r: the service's client; the connection is made with its pool's settings (address, password,
            db, ``decode_responses``).
        consumer: the scheduler's consumer name: ``publish`` acknowledges only entries still pending
            for it (``request_claims.ack_command``). None: every entry given.
    """

    def __init__(self, r: redis.Redis, consumer: str | None = None):
        self.consumer = consumer
        pool = r.connection_pool
        self._conn = pool.connection_class(**pool.connection_kwargs)
        self._unread = 0  # replies of the last ``publish`` not read yet
        self._sent = b""  # its packed commands (sent again if the connection is lost before the replies)

    def call(self, commands: list[tuple]) -> list:
        """Send ``commands`` (argument tuples) in one round trip; their replies, as the RESP parser
        returns them (no redis-py reply callbacks), an error reply as its ``redis.ResponseError`` in
        place. Raises ``redis.ConnectionError`` / ``redis.TimeoutError`` when Redis is unreachable
        after one reconnect (a resent command may run twice: send only ones that may), and the first
        error reply of an earlier ``publish`` (see there)."""
        if not commands:
            return []
        self.flush()
        try:
            return self._round_trip(commands)
        except (redis.ConnectionError, redis.TimeoutError):
            return self._round_trip(commands)  # a Redis restart or an idle connection closed: once more

    def publish(self, by_gateway: dict[str, list], ack_ids: list[str] = ()) -> None:
        """Send one ``XADD`` per gateway of its events (``TokenEvent``s or their ``to_wire`` dicts),
        then acknowledge (XACK) and delete (XDEL) the request entries ``ack_ids`` of finished
        sequences, after their last token is written (with ``consumer``: those still its own);
        without waiting for the replies (pipelined).

        The replies are read by the next ``publish``, ``call`` or ``flush``, by when they have
        arrived: the loop never sleeps in a round trip per worker-step (a blocking read cost it a
        wake-up and the GIL back each time). That call raises the first error reply among them (e.g.
        WRONGTYPE, or NOGROUP when Redis lost the stream). Raises ``redis.ConnectionError`` /
        ``redis.TimeoutError`` when Redis is unreachable after one reconnect. Commands whose replies
        a lost connection took are sent again (``flush``): a resent ``XADD`` duplicates events, which
        the gateway drops by their index.
        """
        if not by_gateway and not ack_ids:
            return
        commands = [
            (
                "XADD",
                messages.responses_stream(gw),
                "MAXLEN",
                "~",
                messages.RESPONSE_STREAM_MAXLEN,
                "*",
                "data",
                messages.encode_events(evs)["data"],
            )
            for gw, evs in by_gateway.items()
        ]
        if ack_ids and self.consumer is not None:
            commands.append(request_claims.ack_command(self.consumer, list(ack_ids)))
        elif ack_ids:
            commands.append(("XACK", messages.REQUESTS, messages.SCHEDULER_GROUP, *ack_ids))
            commands.append(("XDEL", messages.REQUESTS, *ack_ids))
        error = self._collect()  # the last publish's; raised after these commands are sent
        packed = pack_commands(commands)
        try:
            self._send(packed)
        except (redis.ConnectionError, redis.TimeoutError):
            self._send(packed)  # once more, as ``call``
        self._unread, self._sent = len(commands), packed
        if error is not None:
            raise error

    def flush(self) -> None:
        """Read the replies of the last ``publish``; raises its first error reply (the connection
        stays in step). A connection lost before they came is made again and the commands sent once
        more, as ``call`` does (raises ``redis.ConnectionError`` when that fails too)."""
        error = self._collect()
        if error is not None:
            raise error

    def _collect(self) -> redis.ResponseError | None:
        """Read the last ``publish``'s replies (see ``flush``); its first error reply, or None."""
        if not self._unread:
            return None
        n, self._unread = self._unread, 0
        try:
            replies = self._read(n)
        except (redis.ConnectionError, redis.TimeoutError):
            self._send(self._sent)
            replies = self._read(n)
        return next((rep for rep in replies if isinstance(rep, redis.ResponseError)), None)

    def _send(self, packed: bytes) -> None:
        try:
            self._conn.send_packed_command([packed])
        except BaseException:
            self._conn.disconnect()
            raise

    def _read(self, n: int) -> list:
        conn = self._conn
        replies = []
        try:
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as e:  # the reply was read whole: the connection is in step
                    replies.append(e)
        except BaseException:
            conn.disconnect()  # replies may be left unread: the next round trip starts afresh
            raise
        return replies

    def _round_trip(self, commands: list[tuple]) -> list:
        self._send(pack_commands(commands))
        return self._read(len(commands))

    def close(self) -> None:
        """Read what is unread (errors logged), then disconnect."""
        try:
            self.flush()
        except redis.RedisError as e:
            log.warning("the last token events' replies: %s", e)
        self._conn.disconnect()


def pack_commands(commands: list[tuple]) -> bytes:
    """``commands`` (tuples of str / bytes / int arguments) as one buffer of RESP requests: each an
    array of bulk strings, ``*<n>`` CRLF, then ``$<len>`` CRLF ``<bytes>`` CRLF per argument (the
    Redis protocol's request form). redis-py's own packer gives the same bytes at three times the CPU
    (19 vs 6 us for one XADD on the dev machine)."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            raw = arg if isinstance(arg, bytes) else str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def raise_first_error(replies: list) -> None:
    """Raise the first ``redis.ResponseError`` among ``replies`` (``LoopConnection.call``'s), if any."""
    for rep in replies:
        if isinstance(rep, redis.ResponseError):
            raise rep


def raise_first_error_of(reply) -> None:
    """Raise ``reply`` when it is an error reply (a reply nothing else is read from)."""
    raise_first_error([reply])


def trim_control_command() -> tuple:
    """``XTRIM`` of control entries older than ``CONTROL_KEEP_S`` (every scheduler has read them by then)."""
    oldest_ms = int((time.time() - CONTROL_KEEP_S) * 1000)
    return ("XTRIM", messages.CONTROL, "MINID", "~", f"{oldest_ms}-0")
