"""Split brain, step by step: two real ``SchedulerService``s on one real Redis and one real gRPC worker
(simulated runner), driven by hand so that the interleaving is the dangerous one every time.

Scheduler A leases the worker and starts the requests, then stalls (it is simply not driven, and beats
no heartbeat) past its lease. B takes the worker over (a higher fence) and the requests (their
delivery count grows: the requests' fence), and finishes them. A is then driven again with plans and
results still in flight: the worker refuses its plans by fence (counted), A drops the worker and, at
its next heartbeat, the requests B took; every event A still published is dropped by the gateway's
fence check, so each client sees exactly B's tokens, once.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import redis
from stack_harness import wait_for

from fuseserve import messages
from fuseserve.config import EngineConfig
from fuseserve.frontend.output import Delta, OutputState
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port, launch_redis
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.service import heartbeat, redis_io
from fuseserve.scheduler.service.scheduler_service import SchedulerService
from fuseserve.worker.latency_model import get_preset
from fuseserve.worker.server import WorkerServicer
from fuseserve.worker.sim_runner import SimulatedRunner, prompt_key, sim_token

NUM_REQUESTS, NEW_TOKENS = 6, 40
TIMINGS = messages.LeaseTimings(1.0)  # a beat every 0.2 s: a 0.3-s TTL was lost to a loaded CI machine
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture
def stack():
    """``(redis client, redis url, servicer)``: Redis, and a simulated worker registered in it."""
    with launch_redis() as srv:
        r = redis.Redis.from_url(srv.url, decode_responses=True)
        redis_io.setup_streams(r)
        runner = SimulatedRunner(get_preset("a100-llama2-7b"), block_size=16, slowdown=20.0)
        servicer = WorkerServicer(runner, "w0", "sim")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=convert.GRPC_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        server.start()
        info = runner.info
        record = messages.WorkerRecord(
            "w0", f"127.0.0.1:{port}", "sim", info.block_size, info.num_blocks, 4096, info.vocab_size, [], 64
        )
        r.set(messages.worker_key("w0"), record.encode(), ex=600)
        yield r, srv.url, servicer
        server.stop(grace=None)
        r.close()


def _service(url: str, name: str, stop: threading.Event) -> SchedulerService:
    service = SchedulerService(url, EngineConfig(token_budget=64), consumer=name, timings=TIMINGS)
    service.inbox.start(stop)
    return service


def _drive(service: SchedulerService, until, what: str, timeout: float = 60.0) -> None:
    wait_for(lambda: service.run_once() or until(), timeout, what)


def _events(r) -> list:
    return [
        ev for _, fields in r.xrange(messages.responses_stream("gw")) for ev in messages.decode_events(fields)
    ]


def test_a_stalled_scheduler_acts_on_nothing_after_a_peer_took_over(stack):
    r, url, servicer = stack
    prompts = [[5 + i, 6, 7, 8] for i in range(NUM_REQUESTS)]
    for i, prompt in enumerate(prompts):
        r.xadd(
            messages.REQUESTS, messages.RequestMessage(i, f"r{i}", "gw", prompt, PARAMS.to_dict()).encode()
        )
    stop = threading.Event()
    a = _service(url, "sched-a", stop)
    try:
        # A leases the worker (fence 1) and starts every request
        _drive(a, lambda: sum(1 for ev in _events(r) if ev.token) >= 2 * NUM_REQUESTS, "A's first tokens")
        assert servicer.fence == 1 and a.scheduler.slots["w0"].inflight
        # A stalls: no loop, no heartbeat. Its lease expires, its entries go idle; B (beating) takes both
        b = _service(url, "sched-b", stop)
        threading.Thread(target=heartbeat.run, args=(b, stop), daemon=True).start()
        finished = lambda: sum(1 for ev in _events(r) if ev.finish_reason and ev.fence) == NUM_REQUESTS  # noqa: E731
        _drive(b, finished, "B finishing every request it took over")
        assert servicer.fence == 2 and b.num_taken_over == NUM_REQUESTS
        # A runs again: its in-flight results arrive; a plan of it that was queued on the worker when B
        # took over was refused then, or its next plan (fence 1) is refused now: either way counted
        _drive(a, lambda: "w0" not in a.core.workers, "A dropping the worker that refused its plans")
        assert servicer.num_fenced >= 1
        _drive(a, lambda: a.leases.num_fenced == 1, "A's next discovery counting the fenced worker")
        heartbeat.beat(a, redis_io.LoopConnection(a.r))  # its entries: acknowledged by B, not A's any more
        a.run_once()
        assert a.num_lost_to_peers == NUM_REQUESTS and not a.owners
        assert r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)["pending"] == 0  # B finished them
    finally:
        stop.set()
    # the gateway's view: each request gets exactly B's tokens, in order, once
    states = {i: OutputState(prompt, PARAMS, None) for i, prompt in enumerate(prompts)}
    stale = 0
    for ev in _events(r):
        stale += ev.fence == 0 and states[ev.seq_id].fence > 0
        states[ev.seq_id].apply(ev, Delta())
    for i, prompt in enumerate(prompts):
        key = prompt_key(prompt)
        assert states[i].token_ids == [sim_token(key, len(prompt) + k) for k in range(NEW_TOKENS)]
        assert states[i].finish_reason == "length"
    print(f"\nsplit brain: {servicer.num_fenced} plans refused by fence, {stale} stale events dropped")


def test_an_abort_that_comes_before_its_request_is_read_drops_the_request_unrun(stack):
    """A client that leaves while its request still waits in the stream (no scheduler has room): the
    abort on the control stream is remembered, and the request is dropped when it is read."""
    r, url, servicer = stack
    stop = threading.Event()
    a = _service(url, "sched-a", stop)
    try:
        r.xadd(messages.CONTROL, messages.ControlMessage("abort", 7, "abort").encode())
        _drive(a, lambda: 7 in a._early_aborts, "the abort read")
        r.xadd(
            messages.REQUESTS, messages.RequestMessage(7, "r7", "gw", [5, 6, 7], PARAMS.to_dict()).encode()
        )
        r.xadd(
            messages.REQUESTS, messages.RequestMessage(8, "r8", "gw", [5, 6, 8], PARAMS.to_dict()).encode()
        )
        _drive(a, lambda: any(ev.seq_id == 8 and ev.finish_reason for ev in _events(r)), "request 8 served")
        assert not [ev for ev in _events(r) if ev.seq_id == 7]  # never run, nothing published
        assert r.xpending(messages.REQUESTS, messages.SCHEDULER_GROUP)["pending"] == 0  # acknowledged
        assert 7 not in a._early_aborts
    finally:
        stop.set()
