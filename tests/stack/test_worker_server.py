"""The worker's gRPC server with overlap: plans sent ahead on the ``Steps`` stream run in step order,
report the idle gap before them, a dead scheduler's plan still queued after a ``Free(all)`` is
refused, a refused plan fails alone, and a worker gone fails the plans in flight as lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

import grpc
import pytest
from stack_harness import wait_for

from fuseserve import messages
from fuseserve.errors import WorkerFencedError, WorkerLostError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port
from fuseserve.scheduler.service.grpc_worker import GrpcWorker
from fuseserve.types import StepPlan, StepResult
from fuseserve.worker import server as worker_server
from fuseserve.worker.server import WorkerServicer


class _SlowRunner:
    """Records the order plans run in and counts the passes that ended; each pass takes ``pass_s``
    seconds, or, with ``hold`` set, lasts until ``hold(plan)`` returns."""

    def __init__(self, pass_s: float = 0.05):
        self.pass_s = pass_s
        self.hold: Callable[[StepPlan], None] | None = None
        self.order: list[int] = []
        self.num_passes_done = 0
        self.seqs: dict[int, object] = {}
        self.num_free_blocks = 10
        self.num_lora_loads = 0  # the Runner protocol's (no adapters here)

    def take_lora_load_seconds(self) -> list[float]:
        return []

    def step(self, plan: StepPlan) -> StepResult:
        self.order.append(plan.step_id)
        if plan.free_seq_ids == [666]:
            raise ValueError("a plan this runner refuses")
        if self.hold is None:
            time.sleep(self.pass_s)
        else:
            self.hold(plan)
        self.num_passes_done += 1
        return StepResult(plan.step_id, [], forward_seconds=self.pass_s)

    def free(self, ids) -> None:
        pass


class _WorkerClock:
    """The worker's ``time`` in a test: ``perf_counter`` (its pass and idle clock) moves only when the
    test moves ``now``."""

    def __init__(self):
        self.now = 0.0
        self.sleep = time.sleep

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def worker():
    runner = _SlowRunner()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=convert.GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, "w0", "dummy"), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    record = messages.WorkerRecord("w0", f"127.0.0.1:{port}", "dummy", 16, 10, 2048, 100, [2], 64)
    handle = GrpcWorker(record)
    yield runner, handle
    handle.close()
    server.stop(grace=None)


@pytest.fixture
def received(monkeypatch) -> list[int]:
    """The step ids of the plans the worker read off the wire, in the order it read them."""
    ids: list[int] = []
    decode = convert.step_plan_from_proto

    def recording(msg):
        plan = decode(msg)
        ids.append(plan.step_id)
        return plan

    monkeypatch.setattr(convert, "step_plan_from_proto", recording)
    return ids


def _send(handle: GrpcWorker, plan: StepPlan) -> Future:
    """``handle.send`` with a future for the result."""
    out: Future = Future()

    def done(step_id: int, result) -> None:
        assert step_id == plan.step_id
        (out.set_exception if isinstance(result, Exception) else out.set_result)(result)

    handle.send(plan, done)
    return out


def test_plans_sent_ahead_are_read_while_a_pass_runs_and_report_the_idle_gap(worker, received, monkeypatch):
    """The worker reads plans sent ahead while a pass runs, so the next pass starts the moment the
    previous one ended (the wall-time gap is a benchmark number: ``benchmarks/stack_overhead.py``
    prints the worker's idle p50 / p99)."""
    runner, handle = worker
    clock = _WorkerClock()
    monkeypatch.setattr(worker_server, "time", clock)

    def run_pass(plan: StepPlan) -> None:
        if plan.step_id == 0:  # pass 0 ends only once plans 1 and 2 are on the worker
            wait_for(lambda: {1, 2} <= set(received), 30, "plans 1 and 2 read by the worker while pass 0 ran")
        clock.now += 1.0  # each pass takes 1 s on the worker's clock

    runner.hold = run_pass
    handle.reset()
    first = _send(handle, StepPlan(0))
    wait_for(lambda: runner.order == [0], 30, "pass 0 running")
    later = [_send(handle, StepPlan(1)), _send(handle, StepPlan(2))]
    results = [f.result(timeout=30) for f in [first, *later]]
    assert runner.order == [0, 1, 2]
    assert results[0].idle_seconds is None  # the first pass after Free(all): nothing to measure
    # the worker's clock moved only inside passes: plans 1 and 2 each started when the pass before ended
    assert [r.idle_seconds for r in results[1:]] == [0.0, 0.0]
    clock.now += 0.25  # the worker waits 0.25 s for a plan sent only after the last result came back
    assert handle.step(StepPlan(3)).idle_seconds == 0.25


def test_a_dead_schedulers_queued_plan_is_refused_after_free_all(worker, monkeypatch):
    runner, handle = worker
    waiting: list[int] = []  # step ids of the plans that reached their turn wait
    wait_turn = WorkerServicer._wait_turn

    def recording(self, step_id: int, epoch: int) -> None:
        waiting.append(step_id)
        wait_turn(self, step_id, epoch)

    monkeypatch.setattr(WorkerServicer, "_wait_turn", recording)
    handle.reset()
    handle.step(StepPlan(0))
    stale = _send(handle, StepPlan(5))  # waits for plans 1..4, which never come
    wait_for(lambda: 5 in waiting, 30, "plan 5 queued on the worker, waiting for its turn")
    threading.Thread(target=handle.reset).start()  # a new scheduler takes the worker over
    with pytest.raises(RuntimeError, match="ABORTED"):
        stale.result(timeout=10)
    assert runner.order == [0]
    assert handle.step(StepPlan(0)).step_id == 0  # the new session's plans run
    assert runner.order == [0, 0]


def test_a_stale_fence_is_refused_after_a_takeover_and_counted(worker):
    """Split brain at the worker: scheduler A (fence 1) stalls past its lease, B takes the worker over
    (fence 2, Free(all)); A's plans arriving afterwards on its own stream are refused (they would run
    under the epoch of their arrival otherwise) and its Free frees nothing."""
    runner, stale = worker
    stale.fence = 1
    stale.reset()
    assert stale.step(StepPlan(0)).step_id == 0
    fresh = GrpcWorker(stale.record, fence=2)
    try:
        fresh.reset()
        assert fresh.step(StepPlan(0)).step_id == 0
        with pytest.raises(WorkerFencedError, match="fence 1 is below 2") as refused:
            stale.step(StepPlan(1))
        assert refused.value.fence == 2
        assert stale.fenced
        with pytest.raises(WorkerFencedError):  # every later plan of the fenced handle fails at once
            stale.step(StepPlan(2))
        assert runner.order == [0, 0]  # A's plans never ran
        with pytest.raises(WorkerFencedError, match="fence 2 > 1"):
            GrpcWorker(stale.record, fence=1).reset()  # A's Free(all) is refused too
        assert fresh.step(StepPlan(1)).step_id == 1  # B's session goes on
        stub = pb_grpc.WorkerStub(grpc.insecure_channel(stale.record.address))
        health = stub.Health(pb.HealthRequest())
        assert (health.num_fenced, health.fence) == (2, 2)
    finally:
        fresh.close()


def test_plans_out_of_order_on_unary_step_run_in_step_order(worker, received):
    runner, handle = worker

    def run_pass(plan: StepPlan) -> None:
        if plan.step_id == 0:  # pass 0 ends only once plans 2 and 1 are on the worker
            wait_for(lambda: {1, 2} <= set(received), 30, "plans 2 and 1 read by the worker while pass 0 ran")

    runner.hold = run_pass
    handle.reset()
    stub = pb_grpc.WorkerStub(grpc.insecure_channel(handle.record.address))
    first = stub.Step.future(convert.step_plan_to_proto(StepPlan(0)))
    wait_for(lambda: runner.order == [0], 30, "pass 0 running")  # plans 2 and 1 arrive out of order behind it
    later = [stub.Step.future(convert.step_plan_to_proto(StepPlan(i))) for i in (2, 1)]
    assert [f.result(timeout=10).step_id for f in [first, *later]] == [0, 2, 1]
    assert runner.order == [0, 1, 2]


def test_a_refused_plan_fails_alone_and_the_stream_goes_on(worker):
    runner, handle = worker
    handle.reset()
    with pytest.raises(RuntimeError, match="INTERNAL: ValueError: a plan this runner refuses"):
        handle.step(StepPlan(0, free_seq_ids=[666]))
    assert handle.step(StepPlan(1)).step_id == 1
    assert runner.order == [0, 1]


def test_a_worker_gone_fails_the_plans_in_flight_as_lost():
    runner = _SlowRunner()
    release = threading.Event()
    runner.hold = lambda plan: release.wait(30)  # pass 0 lasts until the worker is gone
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=convert.GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, "w0", "dummy"), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    handle = GrpcWorker(messages.WorkerRecord("w0", f"127.0.0.1:{port}", "dummy", 16, 10, 2048, 100, [2], 64))
    try:
        handle.reset()
        in_flight = [_send(handle, StepPlan(0)), _send(handle, StepPlan(1))]
        wait_for(lambda: runner.order == [0], 30, "pass 0 running")
        server.stop(grace=None)
        for f in in_flight:
            with pytest.raises(WorkerLostError):
                f.result(timeout=10)
        with pytest.raises(WorkerLostError):  # and every later plan
            handle.step(StepPlan(2))
        assert runner.num_passes_done == 0  # the plans were lost while pass 0 still ran
    finally:
        release.set()
        handle.close()


def test_a_worker_that_answers_no_plan_in_time_is_cut_off_as_lost(worker, monkeypatch):
    from fuseserve.scheduler.service import grpc_worker

    runner, first = worker
    monkeypatch.setattr(grpc_worker, "STEP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(grpc_worker, "WATCH_S", 0.1)
    release = threading.Event()
    runner.hold = lambda plan: release.wait(60)  # the pass never answers on its own
    handle = GrpcWorker(first.record)  # a fresh stream, whose watchdog runs with the limits above
    try:
        handle.reset()
        with pytest.raises(WorkerLostError, match="no answer"):
            handle.step(StepPlan(0))
        assert runner.order == [0] and runner.num_passes_done == 0  # cut off while the pass still ran
    finally:
        release.set()
        handle.close()


def test_a_driven_loop_runs_plans_and_results_on_its_owners_thread(worker, monkeypatch):
    from fuseserve.scheduler.service import grpc_worker
    from fuseserve.scheduler.service.grpc_worker import IOLoop

    runner, first = worker
    runner.pass_s = 0.01
    io = IOLoop(threaded=False)
    handle = GrpcWorker(first.record, io)  # this thread runs the loop from now on
    try:
        handle.reset()
        got: list[tuple[int, int]] = []  # (step_id, thread) of each result
        for i in range(3):
            handle.send(StepPlan(i), lambda sid, res: got.append((sid, threading.get_ident())))
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            io.wait(1.0)  # the plans go out and the results come in only while the loop runs here
        assert [sid for sid, _ in got] == [0, 1, 2] and runner.order == [0, 1, 2]
        assert {t for _, t in got} == {threading.get_ident()}
        with pytest.raises(RuntimeError, match="threaded"):
            handle.step(StepPlan(3))  # it would wait for a loop only this thread runs
        other: list[BaseException] = []
        t = threading.Thread(target=lambda: other.extend(_raised(handle.reset)))
        t.start()
        t.join()
        assert len(other) == 1 and "owner" in str(other[0])
        timeouts: list[float] = []  # the waits that ran to their timeout
        call_later = io.loop.call_later

        def timed(delay, callback, *args):  # a wait's timeout is the call_later of _resolve
            if callback is not grpc_worker._resolve:
                return call_later(delay, callback, *args)
            return call_later(delay, lambda *a: (timeouts.append(delay), callback(*a)), *args)

        monkeypatch.setattr(io.loop, "call_later", timed)
        threading.Thread(target=io.wake).start()  # a reader thread's hand-over ends the wait early
        io.wait(60.0)
        assert timeouts == [], "the wait ran to its timeout: the wake did not end it"
    finally:
        handle.close()
        io.close()


def _raised(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return [e]
    return []
