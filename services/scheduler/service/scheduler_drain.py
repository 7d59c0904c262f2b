"""Graceful drain of a scheduler service (SIGTERM): finish what it has, or hand it to another scheduler.

``watch`` runs on a thread of its own next to ``SchedulerService.run``. On the first signal the
service stops reading new requests (``accepting``). Then the loop is stopped (``stop``) as soon as

- the service owns no unfinished request (everything finished within the deadline), or
- another scheduler is live: handing over at once beats holding workers for up to the deadline, so
  the other takes the requests (recomputed from their prompts; the gateway drops tokens it already
  sent) and the workers right away, or
- the deadline passed (or a second signal came).

``SchedulerService.close`` then calls ``hand_back``: whatever is still pending becomes claimable at
once, and the worker leases are deleted (not left to expire), so nothing waits for the claim idle
time or the lease TTL (``messages.LeaseTimings``).

A scheduler that is left with no worker (its workers drained or died, a peer holds the rest) hands
its waiting requests to a peer that has workers the same way (``hand_over_waiting``), instead of
failing them with a 503 after ``messages.NO_WORKER_GRACE_S``.
"""

from __future__ import annotations

import logging
import threading

import redis

from fuseserve import messages
from fuseserve.drain_signal import DrainSignal

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05
#: seconds with no worker before the waiting requests go to a peer that has workers (the service's
#: discovery, every 0.5 s, may still find one of its own in this time)
HAND_OVER_AFTER_S = 1.0


def other_schedulers_live(r: redis.Redis, consumer: str) -> int:
    """The number of live schedulers other than ``consumer`` (their liveness keys)."""
    own = messages.scheduler_live_key(consumer)
    return sum(1 for key in r.scan_iter(match=messages.scheduler_live_key("*"), count=100) if key != own)


def peers_with_workers(r: redis.Redis, consumer: str) -> int:
    """The number of workers whose lease another scheduler than ``consumer`` holds (leases live only
    while their holder beats)."""
    keys = list(r.scan_iter(match=messages.worker_lease_key("*"), count=1000))
    return sum(1 for holder in (r.mget(keys) if keys else []) if holder is not None and holder != consumer)


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


def serve_if_no_worker(service, now: float) -> None:
    """Called by ``service``'s loop at ``now`` (monotonic seconds): requests waiting while it has had
    no worker for ``HAND_OVER_AFTER_S`` go to a peer that has workers (``hand_over_waiting``); with
    none for ``messages.NO_WORKER_GRACE_S`` they fail with a 503. With workers, those whose LoRA
    adapter none of them serves fail with a 404 (``Scheduler.fail_unserved_lora``)."""
    if service.scheduler.slots:
        events = service.scheduler.fail_unserved_lora()
        if events:
            log.warning("failing %d waiting requests: no live worker serves their LoRA adapter", len(events))
            service.publish_events(events)
    if service.scheduler.slots or not service.scheduler.waiting:
        service.no_worker_since = None
        return
    if service.no_worker_since is None:
        service.no_worker_since = now
    elapsed = now - service.no_worker_since
    if elapsed >= HAND_OVER_AFTER_S and peers_with_workers(service.r, service.consumer):
        n = hand_over_waiting(service)
        log.warning("no worker: handed %d waiting requests to a peer that has workers", n)
    elif elapsed >= messages.NO_WORKER_GRACE_S:
        log.error(
            "no worker for %.0f s: failing %d waiting requests", elapsed, len(service.scheduler.waiting)
        )
        service.publish_events(service.scheduler.fail_waiting("no worker is available", 503))


def hand_over_waiting(service) -> int:
    """Hand the service's waiting sequences (none has run anywhere yet) to a peer: their entries
    become claimable now (``hand_back``) and the service forgets them (no event, no ack; its
    heartbeat stops touching them). Returns their number."""
    waiting = [seq.seq_id for seq in service.scheduler.waiting]
    owners = [service.owners.pop(seq_id) for seq_id in waiting if seq_id in service.owners]
    for seq_id in waiting:
        service.core.abort(seq_id)
        service.metrics.forget(seq_id)
    hand_back(service, [o.entry_id for o in owners])
    service.num_handed_over += len(owners)
    service.room_changed = True
    return len(owners)


def hand_back(service, entry_ids: list[str] | None = None) -> int:
    """Make request entries claimable by any scheduler now (default: every unfinished request of the
    service): their pending entries get an idle time past any claim idle time (XCLAIM ... IDLE), so
    the next XAUTOCLAIM takes them. The service's heartbeat must not touch them afterwards (stopped,
    or the entries no longer in ``owners``): it would reset their idle time. Returns their number."""
    ids = [o.entry_id for o in list(service.owners.values())] if entry_ids is None else entry_ids
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
