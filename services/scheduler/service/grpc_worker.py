"""A remote worker as an ``EngineCore`` handle: plans over one gRPC stream (``proto/worker.proto``).

Every ``GrpcWorker`` runs on one asyncio event loop (``grpc.aio``, an ``IOLoop``), and each holds one
``Steps`` stream to its worker, opened when the handle is made. ``send(plan, on_result)`` encodes the
plan on the caller's thread and queues it on the stream without waiting for the previous plan's
answer (overlap; the worker runs a session's plans in ``step_id`` order); the loop reads the answers
and calls ``on_result(step_id, result)`` on the loop's thread. The scheduler service drives the loop
on its own thread (``IOLoop(threaded=False)``: the core waits for results by running the loop);
tools and tests share a loop on a thread of its own (``IOLoop.shared()``), to which plans cross over
in batches: one wake-up of the loop per batch of plans, not one per plan.

A stream that breaks or ends (the worker died, restarted, or stopped serving) fails every plan in
flight, and every later one, with ``WorkerLostError``: the core's lost-worker path. So does a plan the
worker refused for a stale fencing token (``WorkerFencedError``: another scheduler took the worker's
lease over; every request carries the handle's ``fence``). A plan the worker
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
from fuseserve.errors import WorkerFencedError, WorkerLostError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.scheduler.migration import MigrationResult
from fuseserve.types import StepPlan, StepResult

STEP_TIMEOUT_S = 300.0  # a pass on a slow CPU can take seconds; a hung worker is cut off after this
WATCH_S = 5.0  # how often the loop looks for a plan older than STEP_TIMEOUT_S
CALL_TIMEOUT_S = 10.0  # Free / opening and closing the stream
MIGRATE_TIMEOUT_S = 150.0  # a KV migration (the worker's own transfer limit is 120 s)

#: called on the loop thread with a plan's step_id and its ``StepResult`` or exception
OnResult = Callable[[int, "StepResult | Exception"], None]

#: the gRPC status a refusal on the stream stands for (the unary ``Step`` answers with that status)
_FAILURE_CODES = {pb.STEP_REJECTED: "INTERNAL", pb.STEP_STALE: "ABORTED"}


class IOLoop:
    """The asyncio event loop every ``GrpcWorker`` of a process (or of one ``IOLoop``) runs on, and
    its outbox: plans handed over by other threads, written to their streams by one callback per batch.

    threaded=True (``IOLoop.shared()``, for tools and tests): the loop runs forever on a thread of its
    own; results arrive on that thread, plans cross over to it.
    threaded=False (the scheduler service): the loop runs on its owner's thread (the first thread
    that calls ``wait`` or ``run``), only inside ``wait(timeout)`` and ``run(coro)``. Plans sent on
    that thread are queued on their streams directly, results are handed to the core on it, and the
    core waits in ``wait``, woken by ``wake``: no thread hand-over, no lock and no cross-thread
    wake-up per worker-step. This is the ``waiter`` an ``EngineCore`` takes.
    """

    _shared: IOLoop | None = None
    _make = threading.Lock()

    def __init__(self, threaded: bool = True):
        self.loop = asyncio.new_event_loop()
        self.threaded = threaded
        self._lock = threading.Lock()
        self._outbox: list[tuple[GrpcWorker, int, pb.StepRequest, OnResult]] = []
        self._owner: int | None = None  # the thread the loop runs on
        self._waiter: asyncio.Future | None = None  # resolved by ``wake`` (driven mode)
        self._woken = False  # a wake came while no ``wait`` ran: the next one returns at once
        if threaded:
            thread = threading.Thread(target=self.loop.run_forever, name="grpc-workers", daemon=True)
            thread.start()
            self._owner = thread.ident

    @classmethod
    def shared(cls) -> IOLoop:
        with cls._make:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _own(self) -> bool:
        """True on the owner's thread (a driven loop is owned by the first thread that runs it)."""
        me = threading.get_ident()
        if self._owner is None and not self.threaded:
            self._owner = me
        return me == self._owner

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop; its result, or what it raised (``TimeoutError`` after
        ``timeout`` seconds). A driven loop runs it on the owner's thread, which must not be inside
        the loop already; from another thread it raises ``RuntimeError``."""
        if self.threaded:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
        if not self._own():
            coro.close()
            raise RuntimeError("a driven IOLoop runs on its owner's thread only")
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def wait(self, timeout: float) -> None:
        """Driven loop: run it on this thread (gRPC reads and writes, result callbacks) until ``wake``
        or ``timeout`` seconds; at least one iteration, so plans queued meanwhile go out."""
        if not self._own():
            raise RuntimeError("a driven IOLoop runs on its owner's thread only")
        fut = self.loop.create_future()
        self._waiter = fut
        if self._woken:
            fut.set_result(None)
        timer = self.loop.call_later(max(0.0, timeout), _resolve, fut)
        try:
            self.loop.run_until_complete(fut)
        finally:
            timer.cancel()
            self._waiter = None
            self._woken = False

    def wake(self) -> None:
        """End the current (or the next) ``wait``; from any thread."""
        if self.threaded:
            return
        if threading.get_ident() == self._owner:
            self._wake_here()
        else:
            self.loop.call_soon_threadsafe(self._wake_here)

    def _wake_here(self) -> None:
        self._woken = True
        if self._waiter is not None:
            _resolve(self._waiter)

    def spawn(self, coro) -> None:
        """Run ``coro`` on the loop as a task of its own (from any thread; a driven loop runs it while
        its owner waits)."""
        if self.threaded:
            asyncio.run_coroutine_threadsafe(coro, self.loop)
        elif self._own():
            self.loop.create_task(coro)
        else:
            self.loop.call_soon_threadsafe(self.loop.create_task, coro)

    def post(self, worker: GrpcWorker, step_id: int, request: pb.StepRequest, on_result: OnResult) -> None:
        """Queue a plan for ``worker``'s stream: at once on a driven loop's own thread; otherwise
        through the outbox, waking the loop only when the outbox was empty."""
        if not self.threaded and self._own():
            worker._enqueue(step_id, request, on_result)
            return
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

    def close(self) -> None:
        """Close a driven loop (its workers closed first); a threaded one lives as long as the process."""
        if not self.threaded and not self.loop.is_closed():
            self.loop.close()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class GrpcWorker:
    """A remote worker as an ``EngineCore`` handle (``send`` for the core, ``step`` for tools and
    tests), on ``io`` (default: the process's threaded ``IOLoop.shared()``). Raises ``grpc.RpcError``
    from ``reset`` when the worker cannot be reached.

    fence: the fencing token of this scheduler's lease on the worker (``worker_leases``), sent with
    every plan and free; 0 for tools and tests that hold no lease."""

    def __init__(self, record: messages.WorkerRecord, io: IOLoop | None = None, fence: int = 0):
        self.record = record
        self.fence = fence
        self._aio = io if io is not None else IOLoop.shared()
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
        self._tasks = [self._aio.loop.create_task(c) for c in (self._read(), self._watch())]

    @property
    def fenced(self) -> bool:
        """True once the worker refused a plan for a stale fence (another scheduler took it over)."""
        return isinstance(self._lost, WorkerFencedError)

    # ----- caller's thread -----
    def send(self, plan: StepPlan, on_result: OnResult) -> None:
        """Send a plan now; ``on_result(plan.step_id, StepResult | exception)`` is called once, on the
        loop thread, when its answer arrives (or at once, on this thread, when it cannot be encoded).
        Never blocks on the worker."""
        try:
            request = convert.step_plan_to_proto(plan)
            request.fence = self.fence
        except Exception as e:  # noqa: BLE001 - a value that cannot be encoded fails only this plan
            on_result(plan.step_id, e)
            return
        self._aio.post(self, plan.step_id, request, on_result)

    def step(self, plan: StepPlan) -> StepResult:
        """Run a plan remotely and wait for it (a threaded ``IOLoop`` only). Raises
        ``WorkerLostError`` when the worker is gone, ``RuntimeError`` when it refused the plan."""
        if not self._aio.threaded:
            raise RuntimeError("GrpcWorker.step needs a threaded IOLoop (use send on a driven one)")
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

    def migrate(self, dest: GrpcWorker, moves: list[tuple[int, list[int], int]], on_done) -> None:
        """Ask this (source) worker to move ``moves`` ``(seq_id, destination block ids, leading blocks
        the destination holds already)`` to ``dest``
        with their K/V (``Migrate``); ``on_done`` gets a ``migration.MigrationResult``, or
        ``WorkerFencedError`` / ``WorkerLostError``, once, on the loop thread. Never blocks."""
        request = pb.MigrateRequest(
            fence=self.fence,
            dest_address=dest.record.address,
            dest_fence=dest.fence,
            moves=[
                pb.SeqMove(seq_id=sid, dest_block_ids=ids, num_shared_blocks=shared)
                for sid, ids, shared in moves
            ],
        )
        self._aio.spawn(self._migrate(request, on_done))

    async def _migrate(self, request: pb.MigrateRequest, on_done) -> None:
        try:
            r = await self._stub.Migrate(request, timeout=MIGRATE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            on_done(WorkerLostError(f"{self.record.address}: Migrate: {e.code().name}"))
            return
        if r.fenced:
            on_done(WorkerFencedError(f"worker {self.record.worker_id}: {r.error}"))
        else:
            on_done(MigrationResult(list(r.moved_seq_ids), r.num_bytes, r.seconds, r.error))

    def reset(self) -> None:
        """Free everything the worker holds (it may have served a previous scheduler); starts this
        scheduler's session (plans numbered from 0). Raises ``WorkerFencedError`` when the worker has
        seen a higher fence than this handle's (its ``fence``: the worker's highest)."""
        response = self._aio.run(self._free_all(), CALL_TIMEOUT_S + 5)
        if response.fenced:
            raise WorkerFencedError(
                f"worker {self.record.worker_id} has seen fence {response.fence} > {self.fence}",
                response.fence,
            )

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
            self._aio.loop.create_task(self._write())

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
                elif msg.failure == pb.STEP_FENCED:  # lost to this scheduler: every later plan fails too
                    self._lost = WorkerFencedError(f"worker {self.record.worker_id}: {msg.error}", msg.fence)
                    result = self._lost
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

    async def _free_all(self) -> pb.FreeResponse:
        return await self._stub.Free(pb.FreeRequest(all=True, fence=self.fence), timeout=CALL_TIMEOUT_S)

    async def _close(self) -> None:
        self._fail_all(WorkerLostError(f"{self.record.address}: closed"))
        for task in self._tasks:
            task.cancel()
        await self._channel.close()
