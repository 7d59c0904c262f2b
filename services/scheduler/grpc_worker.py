"""A remote worker as an ``EngineCore`` handle: plans over one gRPC stream (``proto/worker.proto``).

Every ``GrpcWorker`` of a process runs on one asyncio event-loop thread (``grpc.aio``), and each
holds one ``Steps`` stream to its worker, opened when the handle is made. ``send(plan, on_result)``
encodes the plan on the caller's thread and hands it to the loop without waiting for the previous
plan's answer (overlap; the worker runs a session's plans in ``step_id`` order). Plans handed over
before the loop wakes go out together: one wake-up of the loop per batch of plans, not one per plan.
The loop reads the answers and calls ``on_result(step_id, result)`` on its own thread.

A stream that breaks or ends (the worker died, restarted, or stopped serving) fails every plan in
flight, and every later one, with ``WorkerLostError``: the core's lost-worker path. A plan the worker
refused (its runner raised, or it belongs to a session a later ``Free(all)`` ended) fails alone, with
``RuntimeError``. A worker that answers no plan for ``STEP_TIMEOUT_S`` is cut off as lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from fuseserve import messages
from fuseserve.errors import WorkerLostError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.types import StepPlan, StepResult

STEP_TIMEOUT_S = 300.0  # a pass on a slow CPU can take seconds; a hung worker is cut off after this
WATCH_S = 5.0  # how often the loop looks for a plan older than STEP_TIMEOUT_S
CALL_TIMEOUT_S = 10.0  # Free / opening and closing the stream

#: called on the loop thread with a plan's step_id and its ``StepResult`` or exception
OnResult = Callable[[int, "StepResult | Exception"], None]

#: the gRPC status a refusal on the stream stands for (the unary ``Step`` answers with that status)
_FAILURE_CODES = {pb.STEP_REJECTED: "INTERNAL", pb.STEP_STALE: "ABORTED"}


class _Loop:
    """The event-loop thread shared by every ``GrpcWorker`` of the process, and its outbox: plans
    handed over by other threads, written to their streams by one callback per batch."""

    _shared: _Loop | None = None
    _make = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._outbox: list[tuple[GrpcWorker, int, pb.StepRequest, OnResult]] = []
        threading.Thread(target=self.loop.run_forever, name="grpc-workers", daemon=True).start()

    @classmethod
    def shared(cls) -> _Loop:
        with cls._make:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop from another thread; its result, or what it raised."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, worker: GrpcWorker, step_id: int, request: pb.StepRequest, on_result: OnResult) -> None:
        """Queue a plan for ``worker``'s stream; wakes the loop only when the outbox was empty."""
        with self._lock:
            self._outbox.append((worker, step_id, request, on_result))
            wake = len(self._outbox) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            batch, self._outbox = self._outbox, []
        for worker, step_id, request, on_result in batch:
            worker._enqueue(step_id, request, on_result)


class GrpcWorker:
    """A remote worker as an ``EngineCore`` handle (``send`` for the core, ``step`` for tools and
    tests). Raises ``grpc.RpcError`` from ``reset`` when the worker cannot be reached."""

    def __init__(self, record: messages.WorkerRecord):
        self.record = record
        self._aio = _Loop.shared()
        # loop-thread state: plans written and not answered (step_id -> (on_result, sent at)),
        # the error that ended the stream (then every plan fails with it)
        self._pending: dict[int, tuple[OnResult, float]] = {}
        self._lost: WorkerLostError | None = None
        self._aio.run(self._open(), CALL_TIMEOUT_S)

    async def _open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.record.address, options=convert.GRPC_OPTIONS)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._call = self._stub.Steps()
        self._requests: deque[pb.StepRequest] = deque()  # written by ``_write``, one at a time
        self._writing = False
        self._tasks = [asyncio.ensure_future(c) for c in (self._read(), self._watch())]

    # ----- caller's thread -----
    def send(self, plan: StepPlan, on_result: OnResult) -> None:
        """Send a plan now; ``on_result(plan.step_id, StepResult | exception)`` is called once, on the
        loop thread, when its answer arrives (or at once, on this thread, when it cannot be encoded).
        Never blocks on the worker."""
        try:
            request = convert.step_plan_to_proto(plan)
        except Exception as e:  # noqa: BLE001 - a value that cannot be encoded fails only this plan
            on_result(plan.step_id, e)
            return
        self._aio.post(self, plan.step_id, request, on_result)

    def step(self, plan: StepPlan) -> StepResult:
        """Run a plan remotely and wait for it. Raises ``WorkerLostError`` when the worker is gone,
        ``RuntimeError`` when it refused the plan."""
        answered = threading.Event()
        box: list = []

        def done(step_id: int, result) -> None:
            box.append(result)
            answered.set()

        self.send(plan, done)
        answered.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def reset(self) -> None:
        """Free everything the worker holds (it may have served a previous scheduler); starts this
        scheduler's session (plans numbered from 0)."""
        self._aio.run(self._free_all(), CALL_TIMEOUT_S + 5)

    def close(self) -> None:
        """End the stream and the channel; plans in flight fail with ``WorkerLostError``."""
        try:
            self._aio.run(self._close(), CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closing a dead channel must not fail the caller
            pass

    # ----- loop thread -----
    def _enqueue(self, step_id: int, request: pb.StepRequest, on_result: OnResult) -> None:
        if self._lost is not None:
            on_result(step_id, self._lost)
            return
        self._pending[step_id] = (on_result, time.monotonic())
        self._requests.append(request)
        if not self._writing:  # one write at a time on a stream: the writer takes the rest in turn
            self._writing = True
            asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._requests:
                await self._call.write(self._requests.popleft())
        except Exception:  # noqa: BLE001 - the stream broke or closed; the reader fails the plans in flight
            self._requests.clear()
        finally:
            self._writing = False

    async def _read(self) -> None:
        lost = None
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    lost = WorkerLostError(f"{self.record.address}: the Steps stream ended")
                    break
                entry = self._pending.pop(msg.step_id, None)
                if entry is None:
                    continue
                if msg.failure == pb.STEP_OK:
                    result: StepResult | Exception = convert.step_result_from_proto(msg)
                else:
                    code = _FAILURE_CODES.get(msg.failure, "UNKNOWN")
                    result = RuntimeError(f"worker {self.record.worker_id}: {code}: {msg.error}")
                entry[0](msg.step_id, result)
        except grpc.aio.AioRpcError as e:
            lost = WorkerLostError(f"{self.record.address}: {e.code().name}")
        except asyncio.CancelledError:
            pass
        finally:
            self._fail_all(self._lost or lost or WorkerLostError(f"{self.record.address}: closed"))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            if any(now - sent > STEP_TIMEOUT_S for _, sent in self._pending.values()):
                self._lost = WorkerLostError(f"{self.record.address}: no answer in {STEP_TIMEOUT_S:g} s")
                self._call.cancel()
                return

    def _fail_all(self, error: WorkerLostError) -> None:
        self._lost = error
        pending, self._pending = self._pending, {}
        for step_id, (on_result, _) in pending.items():
            on_result(step_id, error)

    async def _free_all(self) -> None:
        await self._stub.Free(pb.FreeRequest(all=True), timeout=CALL_TIMEOUT_S)

    async def _close(self) -> None:
        self._fail_all(WorkerLostError(f"{self.record.address}: closed"))
        for task in self._tasks:
            task.cancel()
        await self._channel.close()
