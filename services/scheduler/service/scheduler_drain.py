"""Graceful drain of a scheduler service (SIGTERM): finish what it has, or hand it to another scheduler.

``watch`` runs on a thread of its own next to ``SchedulerService.run``. On the first signal the
service stops reading new requests (``accepting``). Then the loop is stopped (``stop``) as soon as

- the service owns no unfinished request (everything finished within the deadline), or
- another scheduler is live: handing over at once beats holding workers for up to the deadline, so
  the other takes the requests (recomputed from their prompts; the gateway drops tokens it already
  sent) and the workers right away, or
- the deadline passed (or a second signal came).

``SchedulerService.close`` then calls ``hand_back``: whatever is still pending becomes claimable at
once, and the worker leases are deleted (not left to expire), so nothing waits for
``messages.CLAIM_IDLE_MS`` or ``messages.SCHEDULER_TTL_S``.
"""

from __future__ import annotations

import logging
import threading

import redis

from fuseserve import messages
from fuseserve.drain_signal import DrainSignal

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05


def other_schedulers_live(r: redis.Redis, consumer: str) -> int:
    """The number of live schedulers other than ``consumer`` (their liveness keys)."""
    own = messages.scheduler_live_key(consumer)
    return sum(1 for key in r.scan_iter(match=messages.scheduler_live_key("*"), count=100) if key != own)


def watch(service, drain: DrainSignal, stop: threading.Event) -> None:
    """Wait for ``drain``; then stop taking requests and set ``stop`` when the service may exit.

    ``service``: a ``SchedulerService`` (``accepting``, ``owners``, ``r``, ``consumer``).
    """
    drain.requested.wait()
    service.accepting = False
    while not stop.is_set():
        if not service.owners:
            log.info("drained: every request finished")
            break
        try:
            peers = other_schedulers_live(service.r, service.consumer)
        except redis.RedisError as e:
            log.warning("drain: cannot see other schedulers (%s)", e)
            peers = 0
        if peers:
            log.info(
                "drain: %d other scheduler(s) live, handing %d requests over", peers, len(service.owners)
            )
            break
        if drain.expired():
            log.warning("drain deadline: handing %d unfinished requests back", len(service.owners))
            break
        drain.wait(WATCH_INTERVAL_S)
    stop.set()


def hand_back(service) -> int:
    """Make the service's unfinished requests claimable by any scheduler now: their pending entries
    get an idle time past ``CLAIM_IDLE_MS`` (XCLAIM ... IDLE), so the next XAUTOCLAIM takes them.
    Call after the heartbeat has stopped (it would reset their idle time). Returns their number."""
    ids = [o.entry_id for o in list(service.owners.values())]
    for i in range(0, len(ids), 500):
        service.r.xclaim(
            messages.REQUESTS,
            messages.SCHEDULER_GROUP,
            service.consumer,
            0,
            ids[i : i + 500],
            idle=messages.HANDBACK_IDLE_MS,
            justid=True,
        )
    return len(ids)
