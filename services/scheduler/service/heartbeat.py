"""The scheduler service's heartbeat: what keeps its liveness, its worker leases and its requests.

``run`` is the body of a thread of its own next to ``SchedulerService.run`` (a long step must not
stop it). Every ``messages.HEARTBEAT_S``, in one round trip on its own connection, it keeps
``SCHEDULER_HEARTBEAT`` (the gateways' sign that some scheduler lives) and this scheduler's liveness
key alive, renews the worker leases it holds (``worker_leases.WorkerLeases``, noting any another
scheduler took) and re-delivers its pending request entries to itself (``touch_commands``), so no
other scheduler's XAUTOCLAIM takes them over while it lives. ``docs/architecture.md`` ("Failures")
walks through the failover this serves.
"""

from __future__ import annotations

import logging
import os
import threading

import redis

from fuseserve import messages
from fuseserve.scheduler.service import redis_io

log = logging.getLogger(__name__)


def touch_commands(service) -> list[tuple]:
    """The commands that re-deliver ``service``'s pending entries to itself (``XCLAIM``: resets
    their idle time), so no other scheduler takes them over while this one lives."""
    ids = [o.entry_id for o in list(service.owners.values())]
    return [
        (
            "XCLAIM",
            messages.REQUESTS,
            messages.SCHEDULER_GROUP,
            service.consumer,
            0,
            *ids[i : i + 500],
            "JUSTID",
        )
        for i in range(0, len(ids), 500)
    ]


def run(service, stop: threading.Event) -> None:
    """Beat until ``stop`` is set. ``service``: a ``SchedulerService`` (``r``, ``consumer``,
    ``leases``, ``owners``)."""
    ttl = messages.SCHEDULER_TTL_S
    conn = redis_io.LoopConnection(service.r)  # this thread's own
    while not stop.is_set():
        try:
            # one round trip: each one woke this thread and cost ~0.4 ms of CPU on the dev machine
            wids, renewals = service.leases.renew_commands()
            replies = conn.call(
                [
                    ("SET", messages.SCHEDULER_HEARTBEAT, service.consumer, "EX", ttl),
                    ("SET", messages.scheduler_live_key(service.consumer), os.getpid(), "EX", ttl),
                    *renewals,
                    *touch_commands(service),
                ]
            )
            service.leases.note_renewals(wids, replies[2 : 2 + len(wids)])
            redis_io.raise_first_error(replies[:2] + replies[2 + len(wids) :])
        except redis.RedisError as e:
            log.warning("scheduler heartbeat failed: %s", e)
        stop.wait(messages.HEARTBEAT_S)
    conn.close()
