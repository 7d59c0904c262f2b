"""The gateway ↔ scheduler contract over Redis.

Keys and streams (all JSON in a single ``data`` field):

- ``REQUESTS`` stream, consumer group ``SCHEDULER_GROUP``: one ``RequestMessage`` per sequence. The
  scheduler acknowledges (XACK) an entry only when its sequence has finished, so a restarted
  scheduler re-claims unfinished requests.
- ``responses_stream(gateway_id)``: one entry per scheduler step and gateway, ``{"events": [...]}``
  with the ``fuseserve.types.TokenEvent`` of every request of that gateway that produced something,
  in its wire form (``TokenEvent.to_wire``: fields at their default left out; ``from_wire`` reads it).
- ``CONTROL`` stream: ``ControlMessage`` (abort: client gone, or a stop string matched).
- ``worker_key(worker_id)``: a worker's ``WorkerRecord``, written with a TTL and refreshed by its
  heartbeat; a worker whose key expires is dead.
- ``SEQ_COUNTER``: INCR gives engine-wide unique sequence ids.
- ``SCHEDULER_HEARTBEAT``: set by the scheduler every ``HEARTBEAT_S`` with a TTL of
  ``SCHEDULER_TTL_S``, from a thread of its own (a long step does not delay it). No key means no
  live scheduler: the gateway answers 503 to new requests, and fails requests in flight with a 503
  error once the key has been missing for ``SCHEDULER_GRACE_S`` (a restarted scheduler re-claims
  unfinished requests within that time).
- A sequence that waits with no live worker for ``NO_WORKER_GRACE_S`` is failed by the scheduler
  with a 503 error event.
- ``scheduler_stats_key(consumer)``: each scheduler's own ``{"waiting": n, "running": n, "time": t,
  "workers": {id: {"admitted", "running", "free_blocks", "num_blocks"}}, ...}`` (with its ``pid``,
  CPU per worker-step, worker idle times and ``metrics_host`` / ``metrics_port``, its Prometheus
  endpoint, port null when not served), written each second with a TTL. Readers add them up
  (``merge_scheduler_stats``, ``read_scheduler_stats``): the gateway answers 429 when too many
  requests wait in all schedulers together.

Several schedulers share the consumer group:

- Their timings are one ``LeaseTimings`` (``fuseserve scheduler --lease-ttl``; every scheduler of a
  deployment uses the same): a lease lives ``ttl_s``, the heartbeat renews it every ``beat_s``.
- ``scheduler_live_key(consumer)``: a scheduler's liveness, refreshed every ``beat_s`` with a TTL of
  ``ttl_s``. The number of such keys is the number of live schedulers.
- ``worker_lease_key(worker_id)``: the consumer name of the scheduler that drives the worker, set
  with ``SET NX`` and renewed with the heartbeat (TTL ``ttl_s``). A scheduler claims unleased workers
  up to its share (workers / live schedulers, rounded up); a dead scheduler's leases expire and a
  live one claims its workers (``Free(all)`` first). Taking a lease takes a **fencing token**
  (``INCR`` of ``worker_fence_key(worker_id)``); every plan and free carries it, and the worker
  refuses those below the highest it has seen: a scheduler that stalled past its lease cannot act.
- A live scheduler re-delivers its pending entries to itself every ``beat_s`` (XCLAIM, which resets
  their idle time), only those still its own (a peer may have claimed some while it stalled: it
  drops those); an entry idle for ``claim_idle_ms`` therefore belongs to a dead or stalled
  scheduler, and a scheduler with room takes it over with XAUTOCLAIM. The entry's delivery count
  is the request's fence: its token events carry it and the gateway drops those of a lower one
  (``scheduler/service/request_claims.py``).

Graceful drain (SIGTERM, ``--drain-timeout``, default ``DRAIN_TIMEOUT_S``):

- A draining worker rewrites its record with ``draining: true``; the scheduler that drives it places
  no new sequence on it and lets its running ones finish. The worker exits once it has held no
  sequence for ``DRAIN_NOTICE_S`` after the notice (every scheduler has read it by then), or at the
  deadline; either way it deletes its record first, and a sequence still on it recomputes elsewhere
  (the lost-worker path).
- A draining scheduler reads no new requests. It finishes its sequences within the deadline when it
  is the only live scheduler; when others live (or at the deadline) it hands everything back at once:
  its pending entries are marked idle (XCLAIM with ``IDLE`` ``HANDBACK_IDLE_MS``), so the next
  XAUTOCLAIM of another scheduler takes them, and its worker leases are deleted, not left to expire.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from fuseserve.errors import InvalidParameterError
from fuseserve.types import TokenEvent

PREFIX = "fuseserve"
REQUESTS = f"{PREFIX}:requests"
SCHEDULER_GROUP = "schedulers"
CONTROL = f"{PREFIX}:control"
SEQ_COUNTER = f"{PREFIX}:seq_counter"
SCHEDULER_STATS = f"{PREFIX}:scheduler:stats"  # prefix of the schedulers' stats keys
SCHEDULER_HEARTBEAT = f"{PREFIX}:scheduler:heartbeat"
SCHEDULER_TTL_S = 5  # seconds the gateways' heartbeat key lives without a refresh
SCHEDULER_GRACE_S = 30.0  # seconds without a scheduler before in-flight requests fail
NO_WORKER_GRACE_S = 30.0  # seconds a sequence may wait with no live worker before it fails
WORKER_PREFIX = f"{PREFIX}:worker:"
#: hash: LoRA adapter name → PEFT directory, the adapters loaded at runtime (``POST
#: /v1/load_lora_adapter``); gateways and workers read it, workers advertise the ones they serve
RUNTIME_LORA = f"{PREFIX}:lora:runtime"
WORKER_TTL_S = 6  # seconds a worker record lives without a heartbeat
HEARTBEAT_S = 2  # seconds between a worker's heartbeats
#: seconds a scheduler's worker leases and liveness key live without a renewal (the default; chosen
#: by measurement, ``benchmarks/takeover.py``: a SIGKILLed scheduler's workers are driven by a peer
#: within 2 s)
LEASE_TTL_S = 1.5
#: heartbeats per lease TTL: a lease is lost only after this many beats in a row were missed
BEATS_PER_TTL = 5
RESPONSE_STREAM_MAXLEN = 100_000
DRAIN_TIMEOUT_S = 30.0  # default seconds a draining worker or scheduler may finish its sequences in
#: seconds a draining worker waits after its notice before it may exit (schedulers discover workers
#: every 0.5 s, so none places a sequence on it after this)
DRAIN_NOTICE_S = 1.5


@dataclass(frozen=True)
class LeaseTimings:
    """How fast a dead or stalled scheduler's workers and requests change hands.

    ttl_s: seconds a worker lease and a scheduler's liveness key live without a renewal; a pending
        request entry idle this long is claimed by a peer.
    """

    ttl_s: float = LEASE_TTL_S

    def __post_init__(self):
        if not self.ttl_s > 0:
            raise InvalidParameterError("lease_ttl", self.ttl_s, "> 0 seconds")

    @property
    def beat_s(self) -> float:
        """Seconds between the scheduler's heartbeats (renewals, touches)."""
        return self.ttl_s / BEATS_PER_TTL

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    @property
    def claim_idle_ms(self) -> int:
        """Milliseconds a pending request entry must be idle before a peer claims it."""
        return self.ttl_ms


#: a pending request entry idle this long belongs to a dead scheduler under the default timings
CLAIM_IDLE_MS = LeaseTimings().claim_idle_ms
#: the idle time a draining scheduler gives its pending entries: claimable at once under any
#: timings up to a minute
HANDBACK_IDLE_MS = 60_000


def responses_stream(gateway_id: str) -> str:
    return f"{PREFIX}:responses:{gateway_id}"


def worker_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"


def worker_lease_key(worker_id: str) -> str:
    """The key holding the consumer name of the scheduler that drives ``worker_id``."""
    return f"{PREFIX}:lease:{worker_id}"


def worker_fence_key(worker_id: str) -> str:
    """The counter whose ``INCR`` gives the fencing token of each new lease on ``worker_id``."""
    return f"{PREFIX}:fence:{worker_id}"


def scheduler_live_key(consumer: str) -> str:
    """A scheduler's liveness key (TTL ``LeaseTimings.ttl_s``)."""
    return f"{PREFIX}:scheduler:live:{consumer}"


def scheduler_stats_key(consumer: str) -> str:
    """One scheduler's own stats record (``SCHEDULER_STATS_PATTERN`` matches them all)."""
    return f"{SCHEDULER_STATS}:{consumer}"


SCHEDULER_STATS_PATTERN = f"{SCHEDULER_STATS}:*"
SCHEDULER_STATS_MAX_AGE_S = 30.0  # a record older than this (seconds) is a dead scheduler's: ignored


def merge_scheduler_stats(raws: list, now: float) -> dict:
    """The engine's stats from the schedulers' own records (JSON strings; None or unparsable ones and
    those older than ``SCHEDULER_STATS_MAX_AGE_S`` at epoch ``now`` are skipped).

    Returns ``{"waiting", "running", "time", "workers", "schedulers", "lora_in_use", "lora_served"}``:
    counts summed over the schedulers, their worker maps merged (each worker is driven by one
    scheduler), ``time`` the newest record's, ``schedulers`` how many records were merged,
    ``lora_in_use`` the LoRA adapters of sequences running or waiting in any scheduler (a set),
    ``lora_served`` the adapters every scheduler driving workers can place (a set: a request for one
    is served whichever scheduler reads it; None: no scheduler drives a worker, its record's
    ``lora_served`` is null); ``{}`` when there is no record.
    """
    out: dict = {}
    for raw in raws:
        try:
            rec = json.loads(raw) if raw else None
            fresh = rec is not None and now - float(rec.get("time", 0)) <= SCHEDULER_STATS_MAX_AGE_S
        except (ValueError, TypeError, AttributeError):
            continue
        if not fresh:
            continue
        if not out:
            out = {"waiting": 0, "running": 0, "time": 0.0, "workers": {}, "schedulers": 0}
            out |= {"lora_in_use": set(), "lora_served": None}
        out["waiting"] += int(rec.get("waiting", 0))
        out["running"] += int(rec.get("running", 0))
        out["time"] = max(out["time"], float(rec["time"]))
        out["workers"].update(rec.get("workers", {}))
        out["schedulers"] += 1
        out["lora_in_use"].update(rec.get("lora_in_use", ()))
        if rec.get("lora_served") is not None:  # a scheduler that drives workers
            served = set(rec["lora_served"])
            out["lora_served"] = served if out["lora_served"] is None else out["lora_served"] & served
    return out


def read_scheduler_stats(r) -> dict:
    """``merge_scheduler_stats`` of every scheduler's record, read with the (synchronous) Redis client ``r``."""
    keys = list(r.scan_iter(match=SCHEDULER_STATS_PATTERN, count=1000))
    return merge_scheduler_stats(r.mget(keys) if keys else [], time.time())


@dataclass
class RequestMessage:
    """A sequence to generate. ``params`` is ``SamplingParams.to_dict()``; ``arrival`` is epoch seconds;
    ``cache_salt``: only sequences with the same salt share cached prefix blocks (None: no salt);
    ``lora``: the LoRA adapter it runs with (a name of the workers' ``lora_modules``; None: the base
    model; left out of the JSON then, so a base request reads the same to a scheduler without it)."""

    seq_id: int
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    params: dict
    arrival: float = 0.0
    cache_salt: str | None = None
    lora: str | None = None

    def encode(self) -> dict[str, str]:
        data = asdict(self)
        if self.lora is None:
            del data["lora"]
        return {"data": json.dumps(data)}

    @classmethod
    def decode(cls, fields: dict) -> RequestMessage:
        raw = fields.get("data", fields.get(b"data"))
        return cls(**json.loads(raw))


def encode_events(events: list[TokenEvent | dict]) -> dict[str, str]:
    """One stream entry for a batch of events: ``TokenEvent``s, or their wire dicts already."""
    wire = [e if type(e) is dict else e.to_wire() for e in events]
    return {"data": json.dumps({"events": wire}, separators=(",", ":"))}


def decode_events(fields: dict) -> list[TokenEvent]:
    """The events of one stream entry (``encode_events``'s)."""
    raw = fields.get("data", fields.get(b"data"))
    return [TokenEvent.from_wire(e) for e in json.loads(raw)["events"]]


@dataclass
class ControlMessage:
    """``kind`` "abort": finish ``seq_id`` now and free its KV blocks (``reason`` "abort" or "stop")."""

    kind: str
    seq_id: int
    reason: str = "abort"

    def encode(self) -> dict[str, str]:
        return {"data": json.dumps(asdict(self))}

    @classmethod
    def decode(cls, fields: dict) -> ControlMessage:
        raw = fields.get("data", fields.get(b"data"))
        return cls(**json.loads(raw))


@dataclass
class WorkerRecord:
    """What a worker registers: where to reach it and its capacity."""

    worker_id: str
    address: str  # host:port of its gRPC server
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    token_budget: int
    metrics_port: int | None = None
    draining: bool = False  # told to stop (SIGTERM): no new sequences, finishing its running ones
    quantization: str | None = None  # the checkpoint's quant_method (gptq, awq, gguf, ...); None: float
    kv_cache_dtype: str | None = None  # KV cache storage: bfloat16, float32, float8_e4m3fn, ...
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters it serves (lora_modules)
    device: str | None = None  # WorkerInfo.device: cpu, cuda:0, simulated (None: not reported)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: str | bytes) -> WorkerRecord:
        return cls(**json.loads(raw))
