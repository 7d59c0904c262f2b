"""Test doubles for the gateway: a fake scheduler on a real Redis, and a gateway served by uvicorn.

``FakeScheduler`` speaks the real contract (``fuseserve.messages``): it reads ``REQUESTS`` through
the consumer group, keeps the ``SCHEDULER_HEARTBEAT`` key alive (with its TTL), registers a worker
key, writes a scheduler stats record (``scheduler_stats_key``), reads ``CONTROL`` aborts,
and each "step" XADDs one event per live sequence to the owning gateway's response stream. A
sequence's output echoes its prompt ids (cycled when ``ignore_eos``), then a hidden EOS with
finish "stop", or finish "length" at ``max_new_tokens``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import redis
import uvicorn

from fuseserve.messages import (
    CONTROL,
    HEARTBEAT_S,
    REQUESTS,
    SCHEDULER_GROUP,
    SCHEDULER_HEARTBEAT,
    SCHEDULER_TTL_S,
    ControlMessage,
    RequestMessage,
    WorkerRecord,
    encode_events,
    responses_stream,
    scheduler_stats_key,
    worker_key,
)
from fuseserve.redis_launcher import free_port

EOS = 2


@dataclass
class _Seq:
    msg: RequestMessage
    output: list[int] = field(default_factory=list)


class FakeScheduler:
    """A scheduler double in a thread. ``token_delay``: seconds per step; ``error_next``: the next
    request gets this error event; ``error_after``: ``(k, error)``, a sequence gets this error event
    instead of its token k; ``duplicate``: every event is sent twice; ``burst``: a sequence's events up to its end go out in one
    XADD (the gateway reads them in one batch). ``kill()`` stops it as a crash
    would (no heartbeat, no events); ``revive()`` restarts it with no sequence in flight."""

    def __init__(self, url: str):
        self.url = url  # the Redis URL (with its password)
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.token_delay = 0.0
        self.error_next: dict | None = None
        self.error_after: tuple[int, dict] | None = None
        self.duplicate = False
        self.burst = False
        self._dead = threading.Event()
        self._halted = threading.Event()  # the loop saw ``_dead``: it beats and sends no more
        self._beat_at = 0.0
        self.requests: list[RequestMessage] = []
        self.aborts: list[ControlMessage] = []
        self._live: dict[int, _Seq] = {}
        self._stop = threading.Event()
        self._control_id = "$"
        try:
            self.r.xgroup_create(REQUESTS, SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass
        self.beat()
        self.add_worker()
        self.set_waiting(0)
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Refresh the scheduler heartbeat key (TTL ``SCHEDULER_TTL_S``)."""
        self.r.set(SCHEDULER_HEARTBEAT, "fake", ex=SCHEDULER_TTL_S)
        self._beat_at = time.monotonic()

    def kill(self) -> None:
        """Stop as a crash would: no heartbeat (key deleted, as if it expired), no more events."""
        self._halted.clear()
        self._dead.set()
        if not self._halted.wait(10):  # the loop finishes its iteration (which may beat) first
            raise RuntimeError("the fake scheduler's loop did not stop")
        self.r.delete(SCHEDULER_HEARTBEAT)

    @property
    def dead(self) -> bool:
        return self._dead.is_set()

    def revive(self) -> None:
        """Start again with nothing in flight (a crash loses the fake's sequences)."""
        self._live.clear()
        self.beat()
        self._dead.clear()

    def add_worker(self) -> None:
        rec = WorkerRecord(
            "fake", "127.0.0.1:1", "smollm2-135m-instruct", 16, 1000, 8192, 49152, [EOS], 256,
            kv_cache_dtype="float8_e4m3fn",
        )  # fmt: skip
        self.r.set(worker_key("fake"), rec.encode())

    def remove_worker(self) -> None:
        self.r.delete(worker_key("fake"))

    def set_waiting(self, waiting: int) -> None:
        self.r.set(
            scheduler_stats_key("harness"),
            json.dumps({"waiting": waiting, "running": 0, "time": time.time()}),
        )

    def num_sent(self, seq_id: int) -> int:
        """Events sent so far for the live sequence ``seq_id`` (0 once it finished, or unknown)."""
        seq = self._live.get(seq_id)
        return len(seq.output) if seq is not None else 0

    def aborts_for(self, seq_ids) -> list[ControlMessage]:
        return [a for a in self.aborts if a.seq_id in set(seq_ids)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.r.close()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._dead.is_set():
                self._halted.set()
                time.sleep(0.02)
                continue
            if time.monotonic() - self._beat_at >= min(HEARTBEAT_S, 0.5):
                self.beat()
            block = None if self._live else 20
            for _s, entries in self.r.xreadgroup(SCHEDULER_GROUP, "fake", {REQUESTS: ">"}, block=block) or []:
                for entry_id, fields in entries:
                    msg = RequestMessage.decode(fields)
                    self.r.xack(REQUESTS, SCHEDULER_GROUP, entry_id)
                    self.requests.append(msg)
                    if self.error_next is not None:
                        error, self.error_next = self.error_next, None
                        self._send(
                            msg.gateway_id, [{"seq_id": msg.seq_id, "error": error, "finish_reason": "abort"}]
                        )
                    else:
                        self._live[msg.seq_id] = _Seq(msg)
            for _s, entries in self.r.xread({CONTROL: self._control_id}, block=None) or []:
                for entry_id, fields in entries:
                    self._control_id = entry_id
                    ctl = ControlMessage.decode(fields)
                    self.aborts.append(ctl)
                    self._live.pop(ctl.seq_id, None)
            if self._control_id == "$":
                last = self.r.xrevrange(CONTROL, count=1)
                self._control_id = last[0][0] if last else "0-0"
            self._step()
            if self.token_delay and self._live:
                time.sleep(self.token_delay)

    def _step(self) -> None:
        by_gateway: dict[str, list[dict]] = {}  # events in their wire form (TokenEvent.to_wire's)
        for sid, seq in list(self._live.items()):
            events = by_gateway.setdefault(seq.msg.gateway_id, [])
            while True:  # one event per step; with ``burst`` all of them up to the sequence's end
                events.append(self._next_event(seq))
                if events[-1].get("finish_reason") is not None:
                    del self._live[sid]
                    break
                if not self.burst:
                    break
        for gateway_id, events in by_gateway.items():
            self._send(gateway_id, events)

    def _next_event(self, seq: _Seq) -> dict:
        p, prompt, i = seq.msg.params, seq.msg.prompt_token_ids, len(seq.output)
        if self.error_after is not None and i == self.error_after[0]:
            seq.output.append(-1)
            return {"seq_id": seq.msg.seq_id, "error": self.error_after[1], "finish_reason": "abort"}
        if i >= len(prompt) and not p["ignore_eos"]:
            token, hidden, finish = EOS, True, "stop"
        else:
            token, hidden = prompt[i % len(prompt)], False
            finish = "length" if i + 1 >= p["max_new_tokens"] else None
        seq.output.append(token)
        ev = {
            "seq_id": seq.msg.seq_id,
            "index": i,
            "token_id": token,
            "hidden": hidden,
            "finish_reason": finish,
        }
        if p["logprobs"] is not None:
            ev["logprob"] = -0.25
            ev["top_logprobs"] = [[token, -0.25], [token + 1, -1.5], [token + 2, -2.5]][: p["logprobs"]]
        return ev

    def _send(self, gateway_id: str, events: list[dict]) -> None:
        if self.duplicate:
            events = [e for e in events for _ in (0, 1)]
        self.r.xadd(responses_stream(gateway_id), encode_events(events))


class ServedApp:
    """An ASGI app served by uvicorn in a thread on a free loopback port; ``url`` is its base URL."""

    def __init__(self, app, startup_timeout: float = 20.0, **config):
        """``config``: more ``uvicorn.Config`` options (``log_level`` defaults to "warning")."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"log_level": "warning", **config}
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="on", **config)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
