"""The scheduler service's heartbeat: what keeps its liveness, its worker leases and its requests.

``run`` is the body of a thread of its own next to ``SchedulerService.run`` (a long step must not
stop it). Every ``LeaseTimings.beat_s``, in one round trip on its own connection, it keeps
``SCHEDULER_HEARTBEAT`` (the gateways' sign that some scheduler lives) and this scheduler's liveness
key alive, renews the worker leases it holds (``worker_leases.WorkerLeases``, noting any another
scheduler took) and re-delivers to itself the pending request entries it still owns
(``request_claims``), so no other scheduler's XAUTOCLAIM takes them over while it lives; those a
peer claimed while this one stalled are handed to the loop to drop (``note_lost_requests``). ``docs/architecture.md`` ("Failures")
walks through the failover this serves.
"""

from __future__ import annotations

import logging
import os
import threading

import redis

from fuseserve import messages
from fuseserve.scheduler.service import redis_io, request_claims

log = logging.getLogger(__name__)


def beat(service, conn: redis_io.LoopConnection) -> None:
    """One heartbeat of ``service`` (a ``SchedulerService``: ``consumer``, ``timings``, ``leases``,
    ``claims``, ``owners``, ``note_lost_requests``), in one round trip on ``conn``: each one woke this
    thread and cost ~0.4 ms of CPU on the dev machine. Raises ``redis.RedisError``."""
    timings = service.timings
    wids, renewals = service.leases.renew_commands()
    entry_ids = [o.entry_id for o in list(service.owners.values())]
    touches = service.claims.touch_commands(service.consumer, entry_ids)
    replies = conn.call(
        [
            ("SET", messages.SCHEDULER_HEARTBEAT, service.consumer, "EX", messages.SCHEDULER_TTL_S),
            ("SET", messages.scheduler_live_key(service.consumer), os.getpid(), "PX", timings.ttl_ms),
            *renewals,
            *touches,
        ]
    )
    service.leases.note_renewals(wids, replies[2 : 2 + len(wids)])
    # Redis restarted without the script: the next beat touches them (well within the idle time)
    touched = service.claims.reload_if_lost(replies[2 + len(wids) :])
    redis_io.raise_first_error(replies[:2] + touched)
    lost = request_claims.parse_touch(touched)
    if lost:
        service.note_lost_requests(lost)


def run(service, stop: threading.Event) -> None:
    """Beat every ``service.timings.beat_s`` until ``stop`` is set (``beat``)."""
    conn = redis_io.LoopConnection(service.r)  # this thread's own
    while not stop.is_set():
        try:
            beat(service, conn)
        except redis.RedisError as e:
            log.warning("scheduler heartbeat failed: %s", e)
        stop.wait(service.timings.beat_s)
    conn.close()
