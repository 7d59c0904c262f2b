"""Which workers a scheduler drives: discovery from the workers' Redis records, under leases.

Workers register ``messages.worker_key(id)`` records (TTL ``WORKER_TTL_S``, refreshed by their
heartbeat). Each scheduler drives the workers it holds a lease on (``messages.worker_lease_key``,
TTL ``LeaseTimings.ttl_s``, renewed by its heartbeat thread), claims unleased ones up to its share
(workers ÷ live schedulers), gives an idle one back when it holds more than its share, and takes over
a dead scheduler's workers when their leases expire. Each lease taken comes with a fencing token
(``messages.worker_fence_key``): the handle sends it with every plan, and the worker refuses a lower
one than it has seen, so a scheduler that stalled past its lease finds its plans refused
(``WorkerFencedError``: it drops the worker) instead of writing into a peer's sequences. See
``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import math

import grpc
import redis

from fuseserve import messages
from fuseserve.errors import WorkerFencedError
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.service.grpc_worker import GrpcWorker, IOLoop

log = logging.getLogger(__name__)

#: extend a lease only while this scheduler holds it
_RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
#: discovery in one round trip: ``{number of live schedulers, {worker record or false, ...}}`` for the
#: key patterns ARGV[1] (worker records) and ARGV[2] (schedulers' liveness keys). Read-only; it scans
#: the keyspace as the client-side SCANs it replaces did (the deployment's keyspace is small: streams,
#: records, leases), but a client round trip costs the scheduler ~80 us of CPU and this saves three.
_DISCOVER_LUA = """
local function scan(pattern)
  local keys, cursor = {}, '0'
  repeat
    local page = redis.call('scan', cursor, 'match', pattern, 'count', 1000)
    cursor = page[1]
    for _, key in ipairs(page[2]) do keys[#keys + 1] = key end
  until cursor == '0'
  return keys
end
local records = {}
for i, key in ipairs(scan(ARGV[1])) do records[i] = redis.call('get', key) end
return {#scan(ARGV[2]), records}
"""
#: take the lease KEYS[1] for ARGV[1] (TTL ARGV[2] ms) unless another scheduler holds it, then a
#: fencing token from the counter KEYS[2], above ARGV[3] (the fence the worker has seen, when the
#: counter was lost with a Redis restart). Returns the token, or 0 when another holds the lease.
_TAKE_LUA = """
local holder = redis.call('get', KEYS[1])
if holder == false then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif holder ~= ARGV[1] then
  return 0
end
local fence = redis.call('incr', KEYS[2])
if fence <= tonumber(ARGV[3]) then
  fence = tonumber(ARGV[3]) + 1
  redis.call('set', KEYS[2], fence)
end
redis.call('expire', KEYS[2], 86400)
return fence
"""
#: delete a lease only while this scheduler holds it
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class WorkerLeases:
    """The workers of one scheduler (``consumer``), added to and removed from ``core`` as they come,
    go, or change hands; ``metrics`` (a ``SchedulerMetrics``, optional) learns the model name and
    forgets departed workers; ``io``: the ``grpc_worker.IOLoop`` of their streams (default: shared).

    Each worker's ``GrpcWorker`` handle is held by the core's registry alone (``core.workers``); this
    class closes it when it stops driving the worker, or, for one the core dropped as lost, when it
    takes it back (``EngineCore.take_lost``) at the next discovery."""

    def __init__(
        self,
        r: redis.Redis,
        consumer: str,
        core: EngineCore,
        metrics=None,
        io: IOLoop | None = None,
        timings: messages.LeaseTimings | None = None,
    ):
        self.r = r
        self.timings = timings or messages.LeaseTimings()
        self.io = io  # the event loop the workers' gRPC streams run on (None: the shared threaded one)
        self.consumer = consumer
        self.core = core
        self.metrics = metrics
        self.leased: set[str] = set()  # workers this scheduler holds a lease on
        self._lost: set[str] = set()  # leases the heartbeat could not renew (another took them)
        self._renew = r.register_script(_RENEW_LUA)
        self._take = r.register_script(_TAKE_LUA)
        self._release = r.register_script(_RELEASE_LUA)
        self._discover = r.register_script(_DISCOVER_LUA)
        self._decoded: dict[str, messages.WorkerRecord] = {}  # record JSON → record, of the last read
        self.num_fenced = 0  # workers lost because they refused a plan for a stale fence

    def discover_command(self) -> tuple:
        """Discovery's one command, to send with others (``redis_io.LoopConnection.call``); its reply
        goes to ``discover``."""
        return ("EVALSHA", self._discover.sha, 0, *self._discover_args())

    @staticmethod
    def _discover_args() -> list[str]:
        return [f"{messages.WORKER_PREFIX}*", messages.scheduler_live_key("*")]

    def read_records(self, reply=None) -> tuple[dict[str, messages.WorkerRecord], int]:
        """The workers' records by worker id and the number of live schedulers (a record unchanged
        since the last read is not decoded again).

        reply: the reply to ``discover_command`` when it was sent already; None (or a Redis that had
        lost the script: NOSCRIPT) reads now, in one round trip. Raises another error reply."""
        if reply is None or isinstance(reply, redis.exceptions.NoScriptError):
            reply = self._discover(args=self._discover_args())  # loads the script when Redis lacks it
        elif isinstance(reply, Exception):
            raise reply
        live, raws = reply
        decoded = {raw: self._decoded.get(raw) or messages.WorkerRecord.decode(raw) for raw in raws if raw}
        self._decoded = decoded
        return {rec.worker_id: rec for rec in decoded.values()}, int(live)

    def discover(self, reply=None) -> None:
        """Follow the worker records: drop workers whose record expired, moved, or whose lease was
        lost; claim unleased workers up to this scheduler's share; give an idle worker back when
        holding more than the share. ``reply``: as ``read_records``."""
        records, live = self.read_records(reply)
        self._close_lost()
        for wid in [w for w in self.leased if w not in self.core.workers]:
            # the core dropped it (its stream broke with plans in flight): release the lease, so the
            # claims below (this scheduler's or another's) can take it again once it is back
            log.info("worker %s was lost; releasing its lease", wid)
            self.drop(wid)
        workers, scheduler = self.core.workers, self.core.scheduler
        lost_now, self._lost = self._lost, set()
        for wid in list(workers):
            lost = wid in lost_now
            if wid not in records or records[wid].address != workers[wid].record.address or lost:
                log.warning(
                    "worker %s is gone%s; resuming its sequences elsewhere", wid, " (lease lost)" * lost
                )
                self.drop(wid)
                continue
            slot = scheduler.slots.get(wid)
            if slot is not None:  # adapters loaded or unloaded at runtime change what it advertises
                slot.lora_adapters = frozenset(records[wid].lora_adapters)
            if records[wid].draining:
                self.core.drain_worker(wid)  # no new sequences there; its running ones finish
        share = math.ceil(len(records) / max(1, live))
        for wid, rec in records.items():
            if wid in self.core.workers or len(self.core.workers) >= share or rec.draining:
                continue
            self._claim(wid, rec)
        if len(self.core.workers) > share:  # another scheduler has fewer: hand over an idle worker
            for wid, slot in list(scheduler.slots.items()):
                if not (slot.running or slot.inflight or slot.pending_free):
                    log.info("handing worker %s over (share %d)", wid, share)
                    self.drop(wid)
                    break

    def _take_fence(self, wid: str, floor: int = 0) -> int:
        """Take ``wid``'s lease (or keep it, when held already) and a fencing token above ``floor``;
        0 when another scheduler holds the lease."""
        keys = [messages.worker_lease_key(wid), messages.worker_fence_key(wid)]
        return int(self._take(keys=keys, args=[self.consumer, self.timings.ttl_ms, floor]))

    def _reset(self, wid: str, handle: GrpcWorker) -> str | None:
        """Start this scheduler's session on a newly leased worker (``Free(all)``: a previous
        scheduler's sequences are gone with it); None when done, else why not. A worker that has seen
        a higher fence than Redis gave (the counter was lost: Redis restarted empty) gets a new
        fence above it."""
        try:
            try:
                handle.reset()
            except WorkerFencedError as e:
                handle.fence = self._take_fence(wid, e.fence)
                if not handle.fence:
                    return "another scheduler took its lease"
                handle.reset()
        except grpc.RpcError as e:
            return f"unreachable ({e.code()})"
        except WorkerFencedError as e:
            return str(e)
        return None

    def _claim(self, wid: str, rec: messages.WorkerRecord) -> None:
        """Take the lease of an unleased worker and add it to the core (nothing when another
        scheduler holds it or it cannot be reached)."""
        lease = messages.worker_lease_key(wid)
        fence = self._take_fence(wid)
        if not fence:
            return  # another scheduler drives it
        handle = GrpcWorker(rec, self.io, fence)
        reason = self._reset(wid, handle)
        if reason is not None:
            log.warning("worker %s at %s not taken: %s", wid, rec.address, reason)
            handle.close()
            self._release(keys=[lease], args=[self.consumer])
            return
        self.leased.add(wid)
        if self.metrics is not None:
            self.metrics.set_model(rec.model)
        self.core.scheduler.eos_token_ids = set(rec.eos_token_ids)
        try:
            self.core.add_worker(
                wid,
                handle,
                rec.num_blocks,
                rec.block_size,
                rec.max_model_len,
                rec.token_budget,
                lora_adapters=set(rec.lora_adapters),
                device=rec.device,
            )
        except Exception:
            handle.close()  # held nowhere else; the next discovery releases the lease
            raise
        log.info(
            "worker %s joined at %s (%d blocks, budget %d, fence %d)",
            wid,
            rec.address,
            rec.num_blocks,
            self.core.scheduler.slots[wid].token_budget,
            handle.fence,
        )

    def drop(self, wid: str) -> None:
        """Stop driving ``wid``: its sequences recompute on other workers; its lease is released."""
        handle = self.core.workers.get(wid)
        self.core.remove_worker(wid)
        if self.metrics is not None:
            self.metrics.drop_worker(wid)
        if handle is not None:
            handle.close()
        if wid in self.leased:
            self.leased.discard(wid)
            self._release(keys=[messages.worker_lease_key(wid)], args=[self.consumer])

    def _close_lost(self) -> None:
        """Close the streams of the workers the core dropped as lost (their leases are released by
        ``discover`` / ``release_all``)."""
        for wid, handle in self.core.take_lost().items():
            if handle.fenced:
                log.warning("worker %s refused a plan: another scheduler took its lease over", wid)
                self.num_fenced += 1
            handle.close()

    def renew(self) -> None:
        """Extend every lease this scheduler holds, in one round trip; a lease another scheduler
        took is noted and its worker dropped by the next ``discover``."""
        wids, commands = self.renew_commands()
        self.note_renewals(wids, self._send(commands))

    def renew_commands(self, wids: list[str] | None = None) -> tuple[list[str], list[tuple]]:
        """The renewal of every lease (``wids``: those workers' only), as commands to send with
        others (the heartbeat's round trip): ``(workers, commands)``, one command per worker, their
        replies for ``note_renewals``. ``EVALSHA`` directly: a redis-py pipeline holding ``Script``
        objects first asks ``SCRIPT EXISTS``, a round trip more."""
        wids = list(self.leased) if wids is None else wids
        ttl_ms = self.timings.ttl_ms
        commands = [
            ("EVALSHA", self._renew.sha, 1, messages.worker_lease_key(wid), self.consumer, ttl_ms)
            for wid in wids
        ]
        return wids, commands

    def note_renewals(self, wids: list[str], replies: list) -> None:
        """Note the leases whose renewal (``replies``, in ``wids`` order, error replies in place) found
        another holder. A Redis that lost the script (restarted) gets it loaded and the renewals sent
        again. Raises the first other error reply."""
        if any(isinstance(rep, redis.exceptions.NoScriptError) for rep in replies):
            self.r.script_load(_RENEW_LUA)
            replies = self._send(self.renew_commands(wids)[1])
        for wid, ok in zip(wids, replies, strict=True):
            if isinstance(ok, Exception):
                raise ok
            if not ok:
                self._lost.add(wid)

    def _send(self, commands: list[tuple]) -> list:
        pipe = self.r.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)

    def release_all(self) -> None:
        """Give up every worker (a clean stop: other schedulers take them over at once)."""
        self._close_lost()
        for wid in list(self.leased):
            try:
                self.drop(wid)
            except redis.RedisError:
                pass  # the lease expires
