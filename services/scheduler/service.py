"""The scheduler service: the engine core with Redis in and gRPC workers out.

``fuseserve scheduler --redis-url URL`` reads requests through the consumer group (acknowledging an
entry only when its sequence finished, so a restarted scheduler re-claims unfinished ones), discovers
workers from their Redis records as they come and go, polls the ``EngineCore`` (each worker stepped
on its own, its next plan sent while its pass runs) and publishes the token events of each poll in
one write per gateway (``fuseserve.messages``). It reads new requests only while its workers have
room for them, so requests stay in the stream for a scheduler that has room.

Several schedulers can run (``fuseserve serve --schedulers N``, compose ``--scale scheduler=N``): each
drives the workers it holds a lease on (``messages.worker_lease_key``), claims unleased ones up to its
share, and takes over a dead scheduler's workers when their leases expire and its pending requests
when they have been idle ``messages.CLAIM_IDLE_MS`` (XAUTOCLAIM). A taken-over request is recomputed
from its prompt; its tokens carry their index, so the gateway drops those it already sent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

import grpc
import redis

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.drain import DrainSignal
from fuseserve.errors import FuseServeError
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler import drain
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.grpc_worker import GrpcWorker
from fuseserve.scheduler.metrics import SchedulerMetrics
from fuseserve.scheduler.scheduler import Scheduler, TokenEvent
from fuseserve.scheduler.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.5
CLAIM_INTERVAL_S = 1.0  # how often pending requests of dead schedulers are looked for
CONTROL_TRIM_INTERVAL_S = 10.0
CONTROL_KEEP_S = 120.0  # control entries younger than this are kept (other schedulers may not have read them)
STATS_INTERVAL_S = 1.0
IDLE_BLOCK_MS = 20
BUSY_POLL_S = 0.02  # longest wait for a worker result before new requests and aborts are read


#: extend a lease only while this scheduler holds it
_RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
#: delete a lease only while this scheduler holds it
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass
class _Owner:
    gateway_id: str
    entry_id: str
    seq: Sequence


def _error_type(status: int) -> str:
    return "service_unavailable" if status == 503 else "server_error"


class SchedulerService:
    """Owns the ``EngineCore``; single-threaded loop over Redis and the core."""

    def __init__(
        self,
        redis_url: str,
        config: EngineConfig,
        consumer: str | None = None,
        metrics_port: int | None = None,
    ):
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.config = config
        self.core = EngineCore(config, eos_token_ids=[])
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.owners: dict[int, _Owner] = {}
        self._leased: set[str] = set()  # workers this scheduler holds a lease on
        self._lost_leases: set[str] = set()  # leases the heartbeat could not renew (another took them)
        self._renew = self.r.register_script(_RENEW_LUA)
        self._release = self.r.register_script(_RELEASE_LUA)
        self._last_claim = 0.0
        self.num_taken_over = 0  # pending requests taken over from dead schedulers
        self.metrics = SchedulerMetrics(metrics_port)
        self.metrics.watch(self.core)
        self._last_discovery = 0.0
        self._last_stats = 0.0
        self._last_trim = 0.0
        self._no_worker_since: float | None = None
        self._control_id = "0-0"
        self._cpu0 = time.process_time()
        self.accepting = True  # reads new requests (False while draining: ``scheduler.drain``)
        self._heartbeat: threading.Thread | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # ----- setup -----
    def _setup_streams(self) -> None:
        try:
            self.r.xgroup_create(messages.REQUESTS, messages.SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        # aborts sent while no scheduler ran apply to the re-claimed requests (processed entries are
        # trimmed as we go, so this reads only what nobody handled)
        self._control_id = "0-0"
        self._read_control()

    def claim_orphans(self) -> None:
        """Take over pending requests of dead schedulers (idle ``CLAIM_IDLE_MS``), as many as there
        is room for. Live schedulers keep theirs fresh (``touch_pending``)."""
        start = "0-0"
        while self.room() > 0:
            start, entries, *_ = self.r.xautoclaim(
                messages.REQUESTS,
                messages.SCHEDULER_GROUP,
                self.consumer,
                min_idle_time=messages.CLAIM_IDLE_MS,
                start_id=start,
                count=min(100, self.room()),
            )
            if entries:
                log.warning("took over %d requests of a dead scheduler", len(entries))
                self.num_taken_over += len(entries)
            self._add_requests(entries, taken_over=True)
            if start == "0-0" or not entries:
                break

    def touch_pending(self) -> None:
        """Re-deliver this scheduler's pending entries to itself (resets their idle time), so no other
        scheduler takes them over while this one lives."""
        ids = [o.entry_id for o in list(self.owners.values())]
        for i in range(0, len(ids), 500):
            self.r.xclaim(
                messages.REQUESTS, messages.SCHEDULER_GROUP, self.consumer, 0, ids[i : i + 500], justid=True
            )

    # ----- workers -----
    def discover(self) -> None:
        """Follow the worker records: drop workers whose record expired, moved, or whose lease was
        lost; claim unleased workers up to this scheduler's share; give an idle worker back when
        holding more than the share."""
        records = {}
        for key in self.r.scan_iter(match=f"{messages.WORKER_PREFIX}*", count=100):
            raw = self.r.get(key)
            if raw:
                rec = messages.WorkerRecord.decode(raw)
                records[rec.worker_id] = rec
        workers = self.core.workers
        for wid in list(workers):
            lost = wid in self._lost_leases
            if wid not in records or records[wid].address != workers[wid].record.address or lost:
                log.warning(
                    "worker %s is gone%s; resuming its sequences elsewhere", wid, " (lease lost)" * lost
                )
                self._drop_worker(wid)
            elif records[wid].draining:
                self.core.drain_worker(wid)  # no new sequences there; its running ones finish
        self._lost_leases.clear()
        live = sum(1 for _ in self.r.scan_iter(match=messages.scheduler_live_key("*"), count=100))
        share = math.ceil(len(records) / max(1, live))
        for wid, rec in records.items():
            if wid in self.core.workers or len(self.core.workers) >= share or rec.draining:
                continue
            lease = messages.worker_lease_key(wid)
            if not self.r.set(lease, self.consumer, nx=True, px=messages.SCHEDULER_TTL_S * 1000):
                continue  # another scheduler drives it
            handle = GrpcWorker(rec)
            try:
                handle.reset()  # a previous scheduler's sequences are gone with it
            except grpc.RpcError as e:
                log.warning("worker %s at %s unreachable: %s", wid, rec.address, e.code())
                handle.close()
                self._release(keys=[lease], args=[self.consumer])
                continue
            self._leased.add(wid)
            self.metrics.set_model(rec.model)
            self.scheduler.eos_token_ids = set(rec.eos_token_ids)
            self.core.add_worker(
                wid, handle, rec.num_blocks, rec.block_size, rec.max_model_len, rec.token_budget
            )
            log.info(
                "worker %s joined at %s (%d blocks, budget %d)",
                wid,
                rec.address,
                rec.num_blocks,
                self.scheduler.slots[wid].token_budget,
            )
        if len(self.core.workers) > share:  # another scheduler has fewer: hand over an idle worker
            for wid, slot in list(self.scheduler.slots.items()):
                if not (slot.running or slot.inflight or slot.pending_free):
                    log.info("handing worker %s over (share %d)", wid, share)
                    self._drop_worker(wid)
                    break
        self.metrics.workers.set(len(self.core.workers))

    def _drop_worker(self, wid: str) -> None:
        """Stop driving ``wid``: its sequences recompute on other workers; its lease is released."""
        handle = self.core.workers.get(wid)
        self.core.remove_worker(wid)
        self.metrics.drop_worker(wid)
        if handle is not None:
            handle.close()
        if wid in self._leased:
            self._leased.discard(wid)
            self._release(keys=[messages.worker_lease_key(wid)], args=[self.consumer])

    # ----- requests -----
    def _add_requests(self, entries, taken_over: bool = False) -> None:
        errors: dict[str, list[messages.TokenMessage]] = defaultdict(list)
        for entry_id, fields in entries:
            if not fields:  # deleted while pending
                self.r.xack(messages.REQUESTS, messages.SCHEDULER_GROUP, entry_id)
                continue
            msg = messages.RequestMessage.decode(fields)
            if msg.seq_id in self.owners:
                continue
            try:
                params = SamplingParams.from_dict(msg.params)
                seq = Sequence(msg.seq_id, msg.prompt_token_ids, params)
                self.core.add_request(seq)
            except FuseServeError as e:
                errors[msg.gateway_id].append(
                    messages.TokenMessage(
                        msg.seq_id,
                        finish_reason="abort",
                        error={"message": str(e), "type": e.error_type, "status": e.http_status},
                    )
                )
                self._ack(entry_id)
                continue
            self.owners[msg.seq_id] = _Owner(msg.gateway_id, entry_id, seq)
            if not taken_over:
                self.metrics.note_arrival(msg.seq_id)
        self._publish(errors)

    def room(self) -> int:
        """New sequences this scheduler's workers could take now (pull-based reading): free
        sequence slots of its workers, less the sequences already waiting; 0 while draining."""
        if not self.accepting:
            return 0
        cap = self.config.max_num_seqs
        free = sum(max(0, cap - len(s.running)) for s in self.scheduler.slots.values() if not s.draining)
        return free - len(self.scheduler.waiting)

    def _read_inputs(self, block_ms: int | None) -> None:
        """Aborts from the control stream and, while there is room, new requests: one round trip
        (blocking up to ``block_ms`` for requests when idle; None: do not block)."""
        count = min(256, self.room())
        pipe = self.r.pipeline(transaction=False)
        # with no room, wait on the control stream instead (an idle loop must not spin)
        pipe.xread({messages.CONTROL: self._control_id}, count=1000, block=None if count > 0 else block_ms)
        if count > 0:
            pipe.xreadgroup(
                messages.SCHEDULER_GROUP, self.consumer, {messages.REQUESTS: ">"}, count=count, block=block_ms
            )
        control, *requests = pipe.execute()
        self._apply_control(control)
        for resp in requests:
            for _, entries in resp or []:
                self._add_requests(entries)

    def _trim_control(self) -> None:
        """Drop control entries older than ``CONTROL_KEEP_S`` (every scheduler has read them by then)."""
        oldest_ms = int((time.time() - CONTROL_KEEP_S) * 1000)
        self.r.xtrim(messages.CONTROL, minid=f"{oldest_ms}-0", approximate=True)

    def _read_control(self) -> None:
        self._apply_control(self.r.xread({messages.CONTROL: self._control_id}, count=1000))

    def _apply_control(self, resp) -> None:
        for _, entries in resp or []:
            for entry_id, fields in entries:
                self._control_id = entry_id
                msg = messages.ControlMessage.decode(fields)
                if msg.kind == "abort" and msg.seq_id in self.owners:
                    reason = FinishReason.STOP if msg.reason == "stop" else FinishReason.ABORT
                    self.core.abort(msg.seq_id, reason)
                    self._finish(msg.seq_id)

    # ----- outputs -----
    def _publish_events(self, events: list[TokenEvent]) -> None:
        by_gateway: dict[str, list[messages.TokenMessage]] = defaultdict(list)
        finished = []
        for ev in events:
            owner = self.owners.get(ev.seq_id)
            if owner is None:
                continue
            tok = ev.token
            by_gateway[owner.gateway_id].append(
                messages.TokenMessage(
                    seq_id=ev.seq_id,
                    index=ev.index,
                    token_id=tok.token_id if tok else None,
                    logprob=tok.logprob if tok else None,
                    top_logprobs=[[t.token_id, t.logprob] for t in tok.top_logprobs] if tok else [],
                    hidden=ev.hidden,
                    prompt_logprobs=messages.prompt_logprobs_to_wire(ev.prompt_logprobs),
                    finish_reason=ev.finish_reason.value if ev.finish_reason else None,
                    error=None
                    if ev.error is None
                    else {
                        "message": ev.error,
                        "type": _error_type(ev.error_status),
                        "status": ev.error_status,
                    },
                )
            )
            if ev.finish_reason is not None:
                finished.append(ev.seq_id)
                self.metrics.forget(ev.seq_id)
        done = [self.owners.pop(sid).entry_id for sid in finished if sid in self.owners]
        self._publish(by_gateway, done)

    def _publish(self, by_gateway: dict[str, list[messages.TokenMessage]], ack_ids: list[str] = ()) -> None:
        """One round trip: one batched write per gateway, then acknowledge (and delete) the request
        entries of finished sequences (after their last token is written)."""
        if not by_gateway and not ack_ids:
            return
        pipe = self.r.pipeline(transaction=False)
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

    def _finish(self, seq_id: int) -> None:
        owner = self.owners.pop(seq_id, None)
        self.metrics.forget(seq_id)
        if owner is not None:
            self._ack(owner.entry_id)

    def _ack(self, entry_id: str) -> None:
        self.r.xack(messages.REQUESTS, messages.SCHEDULER_GROUP, entry_id)
        self.r.xdel(messages.REQUESTS, entry_id)

    # ----- loop -----
    def run_once(self) -> None:
        """One iteration: discovery (periodic), control, new requests, one poll of the core, stats."""
        now = time.monotonic()
        if now - self._last_discovery >= DISCOVERY_INTERVAL_S:
            self.discover()
            self._last_discovery = now
        if now - self._last_claim >= CLAIM_INTERVAL_S:
            self.claim_orphans()
            self._last_claim = now
        busy = self.core.has_work and bool(self.scheduler.slots)
        self._read_inputs(None if busy else IDLE_BLOCK_MS)
        if self.core.has_work and self.scheduler.slots:
            preempted = self.scheduler.num_preemptions
            idle_seen = self.core.stats.num_idle
            events = self.core.poll(timeout=BUSY_POLL_S, record_cpu=False)
            self._publish_events(events)
            self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
            new_idle = min(self.core.stats.num_idle - idle_seen, len(self.core.stats.idle_s))
            # only the new tail: copying the whole window (up to STATS_WINDOW floats) every poll costs
            for idle in itertools.islice(reversed(self.core.stats.idle_s), new_idle):
                self.metrics.worker_idle.observe(idle)
            n = self.core.num_completions
            if n:  # the process's CPU since the last worker-steps, spread over these
                cpu = time.process_time()
                self.stats_cpu(cpu - self._cpu0, n)
                self._cpu0 = cpu
        else:
            self._cpu0 = time.process_time()
        self._fail_if_no_worker(now)
        if now - self._last_trim >= CONTROL_TRIM_INTERVAL_S:
            self._trim_control()
            self._last_trim = now
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._write_stats()
            self._last_stats = now

    def stats_cpu(self, seconds: float, num_steps: int) -> None:
        """Record ``seconds`` of this process's CPU for ``num_steps`` worker-steps (stats + metric)."""
        self.core.stats.add_cpu(seconds, num_steps)
        for _ in range(num_steps):
            self.metrics.cpu_per_step.observe(seconds / num_steps)

    def _write_stats(self) -> None:
        waiting, running = len(self.scheduler.waiting), self.scheduler.num_running
        workers = {
            name: {
                "admitted": s.num_admitted,
                "running": len(s.running),
                "free_blocks": s.account.num_free,
                "num_blocks": s.account.num_blocks,
            }
            for name, s in self.scheduler.slots.items()
        }
        cpu50, cpu99 = self.core.stats.cpu_per_step_ms()
        idle50, idle99 = self.core.stats.idle_ms()
        stats = {
            "waiting": waiting,
            "running": running,
            "time": time.time(),
            "workers": workers,
            "worker_steps": self.core.stats.num_worker_steps,
            "cpu_ms_per_worker_step": {"p50": cpu50, "p99": cpu99},
            "worker_idle_ms": {"p50": idle50, "p99": idle99},
            "surplus_tokens": self.scheduler.num_surplus_tokens,
            "scheduler": self.consumer,
            "pid": os.getpid(),
            "taken_over": self.num_taken_over,
            "metrics_port": self.metrics.port,
            "metrics_host": socket.gethostname(),
        }
        pipe = self.r.pipeline(transaction=False)
        pipe.set(messages.SCHEDULER_STATS, json.dumps(stats), ex=10)
        pipe.set(messages.scheduler_stats_key(self.consumer), json.dumps(stats), ex=10)
        pipe.execute()
        self.metrics.queue_depth.set(waiting)
        self.metrics.running.set(running)

    def _fail_if_no_worker(self, now: float) -> None:
        """Requests waiting while no worker has been alive for ``NO_WORKER_GRACE_S`` fail with a 503."""
        if self.scheduler.slots or not self.scheduler.waiting:
            self._no_worker_since = None
            return
        if self._no_worker_since is None:
            self._no_worker_since = now
        elif now - self._no_worker_since >= messages.NO_WORKER_GRACE_S:
            log.error(
                "no worker for %.0f s: failing %d waiting requests",
                now - self._no_worker_since,
                len(self.scheduler.waiting),
            )
            self._publish_events(self.scheduler.fail_waiting("no worker is available", 503))

    def heartbeat(self, stop: threading.Event) -> None:
        """From a thread of its own (a long step must not stop it), every ``HEARTBEAT_S``: keep
        ``SCHEDULER_HEARTBEAT`` and this scheduler's liveness key alive, renew its worker leases
        (noting any it lost) and keep its pending requests fresh."""
        ttl = messages.SCHEDULER_TTL_S
        while not stop.is_set():
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.set(messages.SCHEDULER_HEARTBEAT, self.consumer, ex=ttl)
                pipe.set(messages.scheduler_live_key(self.consumer), os.getpid(), ex=ttl)
                pipe.execute()
                for wid in list(self._leased):
                    key = messages.worker_lease_key(wid)
                    if not self._renew(keys=[key], args=[self.consumer, ttl * 1000]):
                        self._lost_leases.add(wid)
                self.touch_pending()
            except redis.RedisError as e:
                log.warning("scheduler heartbeat failed: %s", e)
            stop.wait(messages.HEARTBEAT_S)

    def close(self) -> None:
        """A clean stop (after ``run``): give up this scheduler's liveness key, hand its unfinished
        requests back (``drain.hand_back``) and release its worker leases, so others take over at once."""
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            self.r.delete(messages.scheduler_live_key(self.consumer))
            if self.owners:
                log.info("handed %d unfinished requests back", drain.hand_back(self))
        except redis.RedisError as e:
            log.warning("could not hand requests back (%s); they are claimed once idle", e)
        for wid in list(self._leased):
            try:
                self._drop_worker(wid)
            except redis.RedisError:
                pass  # the lease expires
        self.core.close()

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; survives Redis outages (and a Redis that comes back empty)."""
        self._heartbeat = threading.Thread(target=self.heartbeat, args=(stop,), name="heartbeat", daemon=True)
        self._heartbeat.start()
        ready = False
        while not stop.is_set():
            try:
                if not ready:
                    self._setup_streams()
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
    """Entry point of ``fuseserve scheduler``: run until SIGTERM / SIGINT, then drain
    (``fuseserve.scheduler.drain``) and exit."""
    config = EngineConfig(
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
        policy=args.policy,
        block_size=args.block_size,
        overlap=getattr(args, "overlap", True),
        target_itl=getattr(args, "target_itl", None),
        target_prefill_rate=getattr(args, "target_prefill_rate", None),
    )
    service = SchedulerService(args.redis_url, config, metrics_port=getattr(args, "metrics_port", None))
    stop = threading.Event()
    signals = DrainSignal(getattr(args, "drain_timeout", messages.DRAIN_TIMEOUT_S)).install()
    threading.Thread(target=drain.watch, args=(service, signals, stop), name="drain", daemon=True).start()
    print("fuseserve scheduler ready", flush=True)
    service.run(stop)
    service.close()
    return 0
