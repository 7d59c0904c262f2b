"""The scheduler service: Redis in, gRPC workers out, one SplitFuse plan per worker per step.

``fuseserve scheduler --redis-url URL`` reads requests through the consumer group (acknowledging an
entry only when its sequence finished, so a restarted scheduler re-claims unfinished ones), discovers
workers from their Redis records as they come and go, runs ``EngineLoop`` steps over gRPC handles,
and publishes each step's token events in one write per gateway (``fuseserve.messages``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import grpc
import redis

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.errors import FuseServeError
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_loop import EngineLoop
from fuseserve.scheduler.grpc_worker import GrpcWorker
from fuseserve.scheduler.scheduler import Scheduler, TokenEvent
from fuseserve.scheduler.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.5
CONTROL_TRIM_INTERVAL_S = 10.0
STATS_INTERVAL_S = 1.0
IDLE_BLOCK_MS = 20


@dataclass
class _Owner:
    gateway_id: str
    entry_id: str
    seq: Sequence


class SchedulerMetrics:
    def __init__(self, port: int | None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("fuseserve_queue_depth", "sequences waiting", registry=self.registry)
        self.running = Gauge("fuseserve_running_seqs", "sequences running", registry=self.registry)
        self.workers = Gauge("fuseserve_workers_alive", "workers registered", registry=self.registry)
        self.preemptions = Counter(
            "fuseserve_preemptions_total", "sequences preempted", registry=self.registry
        )
        if port:
            start_http_server(port, registry=self.registry)


def _error_type(status: int) -> str:
    return "service_unavailable" if status == 503 else "server_error"


class SchedulerService:
    """Owns the ``Scheduler``; single-threaded loop over Redis and gRPC."""

    def __init__(
        self,
        redis_url: str,
        config: EngineConfig,
        consumer: str | None = None,
        metrics_port: int | None = None,
    ):
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.config = config
        self.scheduler = Scheduler(config, eos_token_ids=[])
        self.loop = EngineLoop(self.scheduler, {})
        self.consumer = consumer or f"{socket.gethostname()}-{int(time.time())}"
        self.owners: dict[int, _Owner] = {}
        self.metrics = SchedulerMetrics(metrics_port)
        self._last_discovery = 0.0
        self._last_stats = 0.0
        self._last_trim = 0.0
        self._no_worker_since: float | None = None
        self._control_id = "0-0"
        self.step_overheads: list[float] = []  # seconds per step not spent in worker forward passes

    # ----- setup -----
    def _setup_streams(self) -> None:
        try:
            self.r.xgroup_create(messages.REQUESTS, messages.SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        # re-claim what a previous scheduler left unfinished (its pending entries)
        start = "0-0"
        while True:
            start, entries, *_ = self.r.xautoclaim(
                messages.REQUESTS,
                messages.SCHEDULER_GROUP,
                self.consumer,
                min_idle_time=0,
                start_id=start,
                count=100,
            )
            self._add_requests(entries)
            if start == "0-0" or not entries:
                break
        # aborts sent while no scheduler ran apply to the re-claimed requests (processed entries are
        # trimmed as we go, so this reads only what nobody handled)
        self._control_id = "0-0"
        self._read_control()

    # ----- workers -----
    def discover(self) -> None:
        """Add workers whose Redis record appeared; remove those whose record expired."""
        records = {}
        for key in self.r.scan_iter(match=f"{messages.WORKER_PREFIX}*", count=100):
            raw = self.r.get(key)
            if raw:
                rec = messages.WorkerRecord.decode(raw)
                records[rec.worker_id] = rec
        for wid in list(self.loop.workers):
            if wid not in records or records[wid].address != self.loop.workers[wid].record.address:
                log.warning("worker %s is gone; resuming its sequences elsewhere", wid)
                self.scheduler.remove_worker(wid)
                self.loop.workers.pop(wid).close()
        for wid, rec in records.items():
            if wid in self.loop.workers:
                continue
            if wid in self.scheduler.slots:  # removed by the loop after a failed step
                self.scheduler.remove_worker(wid)
            handle = GrpcWorker(rec)
            try:
                handle.reset()
            except grpc.RpcError as e:
                log.warning("worker %s at %s unreachable: %s", wid, rec.address, e.code())
                handle.close()
                continue
            self.scheduler.eos_token_ids = set(rec.eos_token_ids)
            self.scheduler.add_worker(
                wid, rec.num_blocks, rec.block_size, rec.max_model_len, rec.token_budget
            )
            self.loop.add_worker(wid, handle)
            log.info(
                "worker %s joined at %s (%d blocks, budget %d)",
                wid,
                rec.address,
                rec.num_blocks,
                self.scheduler.slots[wid].token_budget,
            )
        self.metrics.workers.set(len(self.loop.workers))

    # ----- requests -----
    def _add_requests(self, entries) -> None:
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
                self.scheduler.add(seq)
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
        self._publish(errors)

    def _read_requests(self, block_ms: int | None) -> None:
        resp = self.r.xreadgroup(
            messages.SCHEDULER_GROUP, self.consumer, {messages.REQUESTS: ">"}, count=256, block=block_ms
        )
        for _, entries in resp or []:
            self._add_requests(entries)

    def _trim_control(self) -> None:
        if self._control_id != "0-0":
            self.r.xtrim(messages.CONTROL, minid=self._control_id, approximate=True)

    def _read_control(self) -> None:
        resp = self.r.xread({messages.CONTROL: self._control_id}, count=1000)
        for _, entries in resp or []:
            for entry_id, fields in entries:
                self._control_id = entry_id
                msg = messages.ControlMessage.decode(fields)
                if msg.kind == "abort" and msg.seq_id in self.owners:
                    reason = FinishReason.STOP if msg.reason == "stop" else FinishReason.ABORT
                    self.scheduler.abort(msg.seq_id, reason)
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
                    index=len(owner.seq.output_token_ids) - 1 if tok else -1,
                    token_id=tok.token_id if tok else None,
                    logprob=tok.logprob if tok else None,
                    top_logprobs=[[t.token_id, t.logprob] for t in tok.top_logprobs] if tok else [],
                    hidden=ev.hidden,
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
        self._publish(by_gateway)
        for sid in finished:
            self._finish(sid)

    def _publish(self, by_gateway: dict[str, list[messages.TokenMessage]]) -> None:
        if not by_gateway:
            return
        pipe = self.r.pipeline(transaction=False)
        for gw, evs in by_gateway.items():  # one batched write per gateway per step
            pipe.xadd(
                messages.responses_stream(gw),
                messages.encode_events(evs),
                maxlen=messages.RESPONSE_STREAM_MAXLEN,
                approximate=True,
            )
        pipe.execute()

    def _finish(self, seq_id: int) -> None:
        owner = self.owners.pop(seq_id, None)
        if owner is not None:
            self._ack(owner.entry_id)

    def _ack(self, entry_id: str) -> None:
        self.r.xack(messages.REQUESTS, messages.SCHEDULER_GROUP, entry_id)
        self.r.xdel(messages.REQUESTS, entry_id)

    # ----- loop -----
    def run_once(self) -> None:
        """One iteration: discovery (periodic), control, new requests, one engine step, stats."""
        now = time.monotonic()
        if now - self._last_discovery >= DISCOVERY_INTERVAL_S:
            self.discover()
            self._last_discovery = now
        self._read_control()
        busy = self.scheduler.has_work and bool(self.loop.workers)
        self._read_requests(None if busy else IDLE_BLOCK_MS)
        if self.scheduler.has_work and self.loop.workers:
            t0 = time.perf_counter()
            preempted = self.scheduler.num_preemptions
            events = self.loop.step()
            self._publish_events(events)
            elapsed = time.perf_counter() - t0
            plans = self.loop.last_plans
            if plans:  # tokens and seconds per pass are the workers' metrics; this is the path's cost
                forward = max(self.loop.last_forward_seconds.values(), default=0.0)
                self.step_overheads.append(elapsed - forward)
                del self.step_overheads[:-10000]
            self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
        self._fail_if_no_worker(now)
        if now - self._last_trim >= CONTROL_TRIM_INTERVAL_S:
            self._trim_control()
            self._last_trim = now
        if now - self._last_stats >= STATS_INTERVAL_S:
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
            stats = {"waiting": waiting, "running": running, "time": time.time(), "workers": workers}
            self.r.set(messages.SCHEDULER_STATS, json.dumps(stats), ex=10)
            self.metrics.queue_depth.set(waiting)
            self.metrics.running.set(running)
            self._last_stats = now

    def _fail_if_no_worker(self, now: float) -> None:
        """Requests waiting while no worker has been alive for ``NO_WORKER_GRACE_S`` fail with a 503."""
        if self.loop.workers or not self.scheduler.waiting:
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
        """Keep ``SCHEDULER_HEARTBEAT`` alive from a thread of its own (a long step must not stop it)."""
        while not stop.is_set():
            try:
                self.r.set(messages.SCHEDULER_HEARTBEAT, self.consumer, ex=messages.SCHEDULER_TTL_S)
            except redis.RedisError as e:
                log.warning("scheduler heartbeat failed: %s", e)
            stop.wait(messages.HEARTBEAT_S)

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; survives Redis outages (and a Redis that comes back empty)."""
        threading.Thread(target=self.heartbeat, args=(stop,), name="heartbeat", daemon=True).start()
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
    """Entry point of ``fuseserve scheduler``: run until SIGTERM / SIGINT."""
    config = EngineConfig(
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
        policy=args.policy,
        block_size=args.block_size,
    )
    service = SchedulerService(args.redis_url, config, metrics_port=getattr(args, "metrics_port", None))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("fuseserve scheduler ready", flush=True)
    service.run(stop)
    return 0
