"""The scheduler service: the engine core with Redis in and gRPC workers out.

``fuseserve scheduler --redis-url URL`` runs one loop over an ``EngineCore`` (each worker stepped on
its own, its next plan sent while its pass runs). Its I/O is kept off that loop's path:

- two reader threads block on Redis (``redis_io.RedisInbox``): new requests through the consumer
  group, read only while this scheduler's workers have room (requests stay in the stream for a
  scheduler that has room), and aborts from the control stream; they wake the loop
  (``EngineCore.wakeup``) instead of the loop polling Redis;
- the workers' gRPC streams run on an asyncio loop driven by this same thread
  (``grpc_worker.IOLoop(threaded=False)``, the core's ``waiter``): the core waits for results by
  running it, so a result, its postprocess and the worker's next plan need no hand-over between
  threads;
- the token events of each poll round go out on the loop's own connection, one write per gateway,
  their replies read with the next round's (``redis_io.LoopConnection.publish``); a request's entry
  is acknowledged when its sequence finished, so a restarted scheduler re-claims unfinished ones;
- workers are discovered from their Redis records every ``DISCOVERY_INTERVAL_S`` and driven under a
  lease (``worker_leases.WorkerLeases``).

Several schedulers can run (``fuseserve serve --schedulers N``, compose ``--scale scheduler=N``): each
drives the workers it holds a lease on, claims unleased ones up to its share, and takes over a dead
scheduler's workers when their leases expire and its pending requests when they have been idle
``LeaseTimings.claim_idle_ms`` (XAUTOCLAIM), recomputed from its prompt. Tokens carry their index
and the request's fence (``request_claims``), plans the lease's (``worker_leases``): no token is sent
twice and a stalled scheduler cannot act after a peer took over. One left with no worker hands its
waiting requests to a peer (``scheduler_drain``). ``docs/architecture.md`` walks a request through.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass

import redis

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.drain_signal import DrainSignal
from fuseserve.errors import FuseServeError
from fuseserve.options import from_cli_args
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler import engine_loop
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.scheduler import Scheduler, TokenEvent
from fuseserve.scheduler.sequence import FinishReason, Sequence
from fuseserve.scheduler.service import (
    heartbeat,
    redis_io,
    request_claims,
    scheduler_drain,
    scheduler_metrics,
)
from fuseserve.scheduler.service.grpc_worker import IOLoop
from fuseserve.scheduler.service.redis_io import RedisInbox
from fuseserve.scheduler.service.request_claims import RequestClaims
from fuseserve.scheduler.service.scheduler_metrics import SchedulerMetrics
from fuseserve.scheduler.service.worker_leases import WorkerLeases

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.5
CLAIM_INTERVAL_S = 0.25  # how often pending requests of dead schedulers are looked for
CONTROL_TRIM_INTERVAL_S = 10.0
STATS_INTERVAL_S = 1.0
EARLY_ABORT_KEEP_S = 120.0  # as long as control entries are kept (redis_io.CONTROL_KEEP_S)
EARLY_ABORT_MAX = 10_000  # remembered aborts of unread requests before the old ones are dropped


@dataclass
class _Owner:
    gateway_id: str
    entry_id: str
    seq: Sequence
    fence: int = 0  # the entry's delivery count when taken over (0: first delivery), on its events


class SchedulerService:
    """Owns the ``EngineCore``; one loop over the core, fed by ``RedisInbox``'s reader threads.

    Args:
        redis_url: the Redis holding the streams and worker records.
        config: engine configuration.
        consumer: this scheduler's name in the consumer group (default: host-pid-random).
        metrics_port: serve Prometheus metrics on this port (None: not served).
        timings: lease and claim timings (every scheduler of a deployment uses the same).
        advertise_host: the host name or address others reach its metrics at, written into its stats
            record for ``fuseserve top`` (default: this host's name; a Kubernetes pod passes its IP).
    """

    def __init__(
        self,
        redis_url: str,
        config: EngineConfig,
        consumer: str | None = None,
        metrics_port: int | None = None,
        timings: messages.LeaseTimings | None = None,
        advertise_host: str | None = None,
    ):
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.advertise_host = advertise_host or socket.gethostname()
        self.config = config
        self.timings = timings or messages.LeaseTimings()
        self.claims = RequestClaims(self.r)
        # the workers' gRPC streams run on this thread's loop, and the core waits for results in it
        self.io = IOLoop(threaded=False)
        self.core = EngineCore(config, eos_token_ids=[], waiter=self.io)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.owners: dict[int, _Owner] = {}
        self.inbox = RedisInbox(self.r, self.consumer, wake=self.core.wakeup)
        self.conn = redis_io.LoopConnection(self.r, self.consumer)  # the loop's writes and periodic reads
        self.num_taken_over = 0  # pending requests taken over from dead schedulers
        self.metrics = SchedulerMetrics(metrics_port, config.max_loras)
        self.leases = WorkerLeases(
            self.r, self.consumer, self.core, self.metrics, io=self.io, timings=self.timings
        )
        self.lost_entries: deque[str] = deque()  # entries a peer claimed (heartbeat → loop)
        self.num_lost_to_peers = 0  # requests a peer took over from this scheduler (it had stalled)
        self.num_handed_over = 0  # waiting requests handed to a peer for want of a worker
        self._early_aborts: dict[int, float] = {}  # seq id -> when its abort came, before its request
        self.metrics.watch(self.core)
        self._last_discovery = self._last_claim = self._last_stats = self._last_trim = 0.0
        self.room_changed = True  # recompute ``room`` for the request reader
        self.no_worker_since: float | None = None  # since when it has had no worker (None: it has one)
        self._cpu0 = time.process_time()
        self.accepting = True  # reads new requests (False while draining: ``scheduler.drain``)
        self._heartbeat: threading.Thread | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # ----- requests -----
    def add_requests(self, entries, taken_over: bool = False) -> None:
        """Add request entries: ``(entry_id, fields)`` as read, or ``(entry_id, fields, delivery
        count)`` as taken over (``request_claims.parse_claim``)."""
        errors: dict[str, list[TokenEvent]] = defaultdict(list)
        rejected = []
        for entry_id, fields, *count in entries:
            if not fields:  # deleted while pending
                rejected.append(entry_id)
                continue
            msg = messages.RequestMessage.decode(fields)
            if msg.seq_id in self.owners:
                continue
            if self._early_aborts.pop(msg.seq_id, None) is not None:
                rejected.append(entry_id)  # its client left before any scheduler read it: never run
                continue
            try:
                params = SamplingParams.from_dict(msg.params)
                seq = Sequence(
                    msg.seq_id, msg.prompt_token_ids, params, cache_salt=msg.cache_salt, lora=msg.lora
                )
                self.core.add_request(seq)
            except FuseServeError as e:
                errors[msg.gateway_id].append(
                    TokenEvent(
                        msg.seq_id,
                        None,
                        FinishReason.ABORT,
                        error=str(e),
                        error_status=e.http_status,
                        error_type=e.error_type,
                    )
                )
                rejected.append(entry_id)
                continue
            self.owners[msg.seq_id] = _Owner(msg.gateway_id, entry_id, seq, count[0] if count else 0)
            if not taken_over:
                self.metrics.note_arrival(msg.seq_id)
        self.room_changed = True
        self.conn.publish(errors, rejected)

    def room(self) -> int:
        """New sequences this scheduler's workers could take now (pull-based reading): free
        sequence slots of its workers, less the sequences already waiting; 0 while draining."""
        if not self.accepting:
            return 0
        cap = self.config.max_num_seqs
        free = sum(max(0, cap - len(s.running)) for s in self.scheduler.slots.values() if not s.draining)
        return free - len(self.scheduler.waiting)

    def _apply_inbox(self) -> None:
        """Apply what the reader threads handed over (requests, aborts) and tell the request reader
        how much room there is now. Raises ``redis.ResponseError`` (NOGROUP) when the consumer group
        is gone."""
        batches, nogroup = 0, False
        for kind, entries in self.inbox.take():
            if kind == redis_io.REQUESTS:
                self.add_requests(entries)
                batches += 1
            elif kind == redis_io.CONTROL:
                self._apply_control(entries)
            else:
                nogroup = True
        if batches or self.room_changed or not self.accepting:  # draining: room 0 at once
            self.room_changed = False
            self.inbox.set_room(self.room(), batches)
        if nogroup:
            raise redis.ResponseError("NOGROUP the request stream's consumer group is gone")

    def _apply_control(self, entries) -> None:
        """Aborts: of an owned sequence, now; of one not read yet (its client left while it waited in
        the request stream), remembered for ``EARLY_ABORT_KEEP_S``, so that whichever scheduler reads
        it drops it unrun."""
        now = time.monotonic()
        for _, fields in entries:
            msg = messages.ControlMessage.decode(fields)
            if msg.kind != "abort":
                continue
            if msg.seq_id in self.owners:
                reason = FinishReason.STOP if msg.reason == "stop" else FinishReason.ABORT
                self.core.abort(msg.seq_id, reason)
                self._finish(msg.seq_id)
            else:
                self._early_aborts[msg.seq_id] = now
        if len(self._early_aborts) > EARLY_ABORT_MAX:
            self._early_aborts = {s: t for s, t in self._early_aborts.items() if now - t < EARLY_ABORT_KEEP_S}

    # ----- outputs -----
    def publish_events(self, events: list[TokenEvent]) -> None:
        """Write one poll round's events (one ``XADD`` per gateway) and acknowledge finished requests."""
        by_gateway: dict[str, list[dict]] = defaultdict(list)
        done = []
        for ev in events:
            owner = self.owners.get(ev.seq_id)
            if owner is None:
                continue
            ev.fence = owner.fence
            by_gateway[owner.gateway_id].append(ev.to_wire())
            if ev.finish_reason is not None:
                done.append(self.owners.pop(ev.seq_id).entry_id)
                self.metrics.forget(ev.seq_id)
        if done:
            self.room_changed = True
        self.conn.publish(by_gateway, done)

    def note_lost_requests(self, entry_ids: list[str]) -> None:
        """From the heartbeat: request entries a peer claimed while this scheduler stalled. The loop
        drops them (``request_claims.drop_lost``): the peer serves them, and an ack from here would end its claim."""
        self.lost_entries.extend(entry_ids)
        self.core.wakeup()

    def _finish(self, seq_id: int) -> None:
        owner = self.owners.pop(seq_id, None)
        self.metrics.forget(seq_id)
        if owner is not None:
            self.room_changed = True
            self.conn.publish({}, [owner.entry_id])

    # ----- loop -----
    def run_once(self) -> None:
        """One iteration of the engine loop (``engine_loop.run_once``) with this service as its port."""
        engine_loop.run_once(self.core, self)

    # ----- the engine loop's port (``engine_loop.EnginePort``) -----
    record_cpu = False  # the service spreads its whole process's CPU over the worker-steps (send)

    def receive(self) -> float:
        """Periodic work (discovery, take-over, stats) when due, then what the readers handed over;
        returns the seconds until the next periodic task (a hand-over or a result ends it sooner)."""
        now = time.monotonic()
        request_claims.drop_lost(self)
        self._periodic(now)
        scheduler_drain.serve_if_no_worker(self, now)
        self._apply_inbox()
        due = min(self._last_discovery + DISCOVERY_INTERVAL_S, self._last_stats + STATS_INTERVAL_S)
        return max(0.0, due - time.monotonic())

    def send(self, events: list[TokenEvent]) -> None:
        """Publish a poll's events to their gateways, record its stats and its CPU per worker-step."""
        self.publish_events(events)
        self.metrics.record(self.core.make_stats())  # the events since the last record
        cpu = time.process_time()  # the process's CPU since the last worker-steps, spread over these
        self.stats_cpu(cpu - self._cpu0, self.core.num_completions)
        self._cpu0 = cpu

    def idle(self, timeout: float) -> None:
        """Nothing to run: wait for the readers or a worker (the core's waiter runs the gRPC I/O)."""
        self.core.wait(timeout)
        self._cpu0 = time.process_time()

    def _periodic(self, now: float) -> None:
        """The periodic tasks that are due (discovery, take-over, control trim, stats), their Redis
        commands in one round trip: on the dev machine a round trip after the loop slept costs
        ~0.5 ms of CPU, and an idle scheduler's CPU was mostly these."""
        commands, then = [], []
        if now - self._last_discovery >= DISCOVERY_INTERVAL_S:
            commands.append(self.leases.discover_command())
            then.append(self._discovered)
            self._last_discovery = now
        if now - self._last_claim >= CLAIM_INTERVAL_S:
            self._last_claim = now
            if self.room() > 0:
                commands.append(request_claims.orphans_command(self))
                then.append(functools.partial(request_claims.claim_orphans, self))
        if now - self._last_trim >= CONTROL_TRIM_INTERVAL_S:
            commands.append(redis_io.trim_control_command())
            then.append(redis_io.raise_first_error_of)
            self._last_trim = now
        if now - self._last_stats >= STATS_INTERVAL_S:
            commands.append(scheduler_metrics.stats_command(self))
            then.append(redis_io.raise_first_error_of)
            self._last_stats = now
        for handle, reply in zip(then, self.conn.call(commands), strict=True):
            handle(reply)

    def _discovered(self, reply) -> None:
        self.leases.discover(reply)
        self.metrics.workers.set(len(self.scheduler.slots))
        self.room_changed = True

    def stats_cpu(self, seconds: float, num_steps: int) -> None:
        """Record ``seconds`` of this process's CPU for ``num_steps`` worker-steps (stats + metric)."""
        self.core.stats.add_cpu(seconds, num_steps)
        for _ in range(num_steps):
            self.metrics.cpu_per_step.observe(seconds / num_steps)

    def close(self) -> None:
        """A clean stop (after ``run``): give up this scheduler's liveness key, hand its unfinished requests
        back (``scheduler_drain.hand_back``) and release its worker leases, so others take over at once."""
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            self.r.delete(messages.scheduler_live_key(self.consumer))
            if self.owners:
                log.info("handed %d unfinished requests back", scheduler_drain.hand_back(self))
        except redis.RedisError as e:
            log.warning("could not hand requests back (%s); they are claimed once idle", e)
        self.leases.release_all()
        self.conn.close()
        self.core.close()
        self.io.close()

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; survives Redis outages (and a Redis that comes back empty)."""
        self._heartbeat = threading.Thread(
            target=heartbeat.run, args=(self, stop), name="heartbeat", daemon=True
        )
        self._heartbeat.start()
        ready = False
        while not stop.is_set():
            try:
                if not ready:
                    redis_io.setup_streams(self.r)
                    self.inbox.start(stop)  # once; the readers outlive a Redis restart
                    ready = True
                self.run_once()
            except redis.ConnectionError as e:
                log.error("redis unavailable (%s); retrying", e)
                stop.wait(1.0)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.error("redis lost the request stream (restarted empty?); recreating it")
                ready = False


def run_scheduler(args: argparse.Namespace) -> int:
    """Entry point of ``fuseserve scheduler``: run until SIGTERM / SIGINT, then drain and exit."""
    config = from_cli_args(EngineConfig, args)  # the engine options the scheduler offers
    timings = messages.LeaseTimings(args.lease_ttl)
    service = SchedulerService(
        args.redis_url,
        config,
        metrics_port=args.metrics_port,
        timings=timings,
        advertise_host=args.advertise_host,
    )
    stop = threading.Event()
    watched = (service, DrainSignal(args.drain_timeout).install(), stop)
    threading.Thread(target=scheduler_drain.watch, args=watched, name="drain", daemon=True).start()
    print("fuseserve scheduler ready", flush=True)
    service.run(stop)
    service.close()
    return 0
