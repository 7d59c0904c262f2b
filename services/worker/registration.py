"""The worker's presence in Redis and its drain: its record (``messages.WorkerRecord``), kept alive by a
heartbeat while it serves and marked ``draining`` on SIGTERM (``Registration``), and the wait until no
scheduler places anything on it any more (``wait_drained``). ``server.run_worker`` uses both."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fuseserve import messages
from fuseserve.drain_signal import DrainSignal

log = logging.getLogger(__name__)


def wait_drained(runner, drain: DrainSignal) -> int:
    """After the drain notice: wait until ``runner`` has held no sequence for ``DRAIN_NOTICE_S`` since
    the notice (no scheduler places one on it any more), or until ``drain`` expires. Returns the
    number of sequences still held (to be handed back), 0 when drained."""
    notice = time.monotonic()
    while not drain.expired():
        if not runner.seqs and time.monotonic() - notice >= messages.DRAIN_NOTICE_S:
            return 0
        drain.wait(0.05)
    n = len(runner.seqs)
    if n:
        log.warning("drain deadline: handing %d sequences back for recompute elsewhere", n)
    return n


class Registration:
    """The worker's Redis record (``messages.WorkerRecord``): written every ``HEARTBEAT_S`` while it
    serves, marked ``draining`` on the drain notice, deleted when it stops. One writer at a time, so
    the drain notice is never overwritten by a heartbeat in flight. ``set_runtime_loras`` (with
    ``--allow-runtime-lora``: ``ModelRunner.set_runtime_loras``) is given the runtime adapters of
    ``messages.RUNTIME_LORA`` before each write, and the record advertises what it returns."""

    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        record: messages.WorkerRecord,
        set_runtime_loras: Callable[[dict[str, str]], list[str]] | None = None,
    ):
        import redis

        self.r = redis.Redis.from_url(redis_url)
        self._error = redis.RedisError
        self.key = messages.worker_key(worker_id)
        self.record = record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._set_runtime_loras = set_runtime_loras
        self._beat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)

    def write(self) -> None:
        with self._lock:
            try:
                if self._set_runtime_loras is not None:
                    self._refresh_loras()
                self.r.set(self.key, self.record.encode(), ex=messages.WORKER_TTL_S)
            except self._error as e:
                log.warning("heartbeat failed: %s", e)

    def _refresh_loras(self) -> None:
        """Serve the adapters of the hash ``messages.RUNTIME_LORA`` and advertise what is served."""
        raw = self.r.hgetall(messages.RUNTIME_LORA)
        paths = {k.decode(): v.decode() for k, v in raw.items()}
        self.record.lora_adapters = self._set_runtime_loras(paths)

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            self.write()
            self._stop.wait(messages.HEARTBEAT_S)

    def start(self) -> None:
        self._beat.start()

    def drain(self) -> None:
        """Say ``draining``: schedulers place no new sequence here."""
        with self._lock:
            self.record.draining = True
        self.write()

    def stop(self) -> None:
        """Stop the heartbeat and delete the record."""
        self._stop.set()
        self._beat.join()
        with self._lock:
            try:
                self.r.delete(self.key)
            except self._error:
                pass
