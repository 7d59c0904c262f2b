"""The worker's gRPC server with overlap: plans sent ahead on the ``Steps`` stream run in step order,
report the idle gap before them, a dead scheduler's plan still queued after a ``Free(all)`` is
refused, a refused plan fails alone, and a worker gone fails the plans in flight as lost."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future

import grpc
import pytest

from fuseserve import messages
from fuseserve.errors import WorkerLostError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.redis_launcher import free_port
from fuseserve.scheduler.grpc_worker import GrpcWorker
from fuseserve.types import StepPlan, StepResult
from fuseserve.worker.server import WorkerServicer


class _SlowRunner:
    """Records the order plans run in; each pass takes ``pass_s`` seconds."""

    def __init__(self, pass_s: float = 0.05):
        self.pass_s = pass_s
        self.order: list[int] = []
        self.seqs: dict[int, object] = {}
        self.num_free_blocks = 10

    def step(self, plan: StepPlan) -> StepResult:
        self.order.append(plan.step_id)
        if plan.free_seq_ids == [666]:
            raise ValueError("a plan this runner refuses")
        time.sleep(self.pass_s)
        return StepResult(plan.step_id, [], forward_seconds=self.pass_s)

    def free(self, ids) -> None:
        pass


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


def _send(handle: GrpcWorker, plan: StepPlan) -> Future:
    """``handle.send`` with a future for the result."""
    out: Future = Future()

    def done(step_id: int, result) -> None:
        assert step_id == plan.step_id
        (out.set_exception if isinstance(result, Exception) else out.set_result)(result)

    handle.send(plan, done)
    return out


def test_plans_sent_ahead_run_in_step_order_back_to_back(worker):
    runner, handle = worker
    handle.reset()
    first = _send(handle, StepPlan(0))
    time.sleep(0.01)  # plan 0 is running: plans 1 and 2 arrive behind it
    later = [_send(handle, StepPlan(1)), _send(handle, StepPlan(2))]
    results = [f.result(timeout=10) for f in [first, *later]]
    assert runner.order == [0, 1, 2]
    assert results[0].idle_seconds is None  # the first pass after Free(all): nothing to measure
    # plans 1 and 2 were queued on the worker: each started as soon as the previous pass ended
    assert all(r.idle_seconds is not None and r.idle_seconds < 0.02 for r in results[1:])


def test_a_dead_schedulers_queued_plan_is_refused_after_free_all(worker):
    runner, handle = worker
    handle.reset()
    handle.step(StepPlan(0))
    stale = _send(handle, StepPlan(5))  # waits for plans 1..4, which never come
    time.sleep(0.1)
    threading.Thread(target=handle.reset).start()  # a new scheduler takes the worker over
    with pytest.raises(RuntimeError, match="ABORTED"):
        stale.result(timeout=10)
    assert runner.order == [0]
    assert handle.step(StepPlan(0)).step_id == 0  # the new session's plans run
    assert runner.order == [0, 0]


def test_plans_out_of_order_on_unary_step_run_in_step_order(worker):
    runner, handle = worker
    handle.reset()
    stub = pb_grpc.WorkerStub(grpc.insecure_channel(handle.record.address))
    first = stub.Step.future(convert.step_plan_to_proto(StepPlan(0)))
    time.sleep(0.01)  # plan 0 is running: plans 2 and 1 arrive out of order behind it
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
    runner = _SlowRunner(pass_s=0.5)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=convert.GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, "w0", "dummy"), server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    handle = GrpcWorker(messages.WorkerRecord("w0", f"127.0.0.1:{port}", "dummy", 16, 10, 2048, 100, [2], 64))
    try:
        handle.reset()
        in_flight = [_send(handle, StepPlan(0)), _send(handle, StepPlan(1))]
        time.sleep(0.1)
        server.stop(grace=None)
        for f in in_flight:
            with pytest.raises(WorkerLostError):
                f.result(timeout=10)
        with pytest.raises(WorkerLostError):  # and every later plan
            handle.step(StepPlan(2))
    finally:
        handle.close()


def test_a_worker_that_answers_no_plan_in_time_is_cut_off_as_lost(worker, monkeypatch):
    from fuseserve.scheduler import grpc_worker

    runner, first = worker
    monkeypatch.setattr(grpc_worker, "STEP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(grpc_worker, "WATCH_S", 0.1)
    runner.pass_s = 2.0
    handle = GrpcWorker(first.record)  # a fresh stream, whose watchdog runs with the limits above
    try:
        handle.reset()
        started = time.monotonic()
        with pytest.raises(WorkerLostError, match="no answer"):
            handle.step(StepPlan(0))
        assert time.monotonic() - started < 1.5
    finally:
        handle.close()


def test_a_driven_loop_runs_plans_and_results_on_its_owners_thread(worker):
    from fuseserve.scheduler.grpc_worker import IOLoop

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
        threading.Timer(0.1, io.wake).start()  # a reader thread's hand-over ends the wait early
        started = time.monotonic()
        io.wait(5.0)
        assert time.monotonic() - started < 2.0
    finally:
        handle.close()
        io.close()


def _raised(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return [e]
    return []
