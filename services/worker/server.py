"""The worker service: a runner behind gRPC, registered in Redis with a heartbeat.

``fuseserve worker --redis-url URL --model M --host H --port P [--advertise-host NAME]`` loads the
model, sizes its KV cache, chooses its token budget (profiling, cached), serves
``fuseserve.worker.v1.Worker`` and keeps ``fuseserve:worker:<id>`` alive in Redis (TTL
``WORKER_TTL_S``, refreshed every ``HEARTBEAT_S``) so schedulers discover it as it comes and goes.

``--simulate PRESET [--simulate-slowdown F]`` serves the same server with a ``SimulatedRunner``
(``sim_runner.py``): no model, no torch; the token budget defaults to the preset's knee and the KV
blocks to its capacity (or ``--kv-cache-memory`` at the preset's bytes per token).

SIGTERM drains the worker (``fuseserve.drain_signal``; ``--drain-timeout``): its record says ``draining``, so
its scheduler places no new sequence on it; it serves its running sequences to their end, then
deletes its record and exits 0. At the deadline (or a second signal) it deletes its record and stops
serving: the sequences still on it recompute on other workers (the scheduler's lost-worker path).
"""

from __future__ import annotations

import argparse
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent import futures

import grpc

from fuseserve import messages
from fuseserve.drain_signal import DrainSignal
from fuseserve.errors import InvalidBlockError, SchedulerError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.types import StepPlan
from fuseserve.worker import kv_migration
from fuseserve.worker.registration import Registration, wait_drained
from fuseserve.worker.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


#: seconds a plan waits for its predecessor (a lower step_id) before it runs anyway
ORDER_WAIT_S = 5.0
#: seconds a migration's transfer to the destination may take
MIGRATE_TIMEOUT_S = 120.0


class WorkerServicer(pb_grpc.WorkerServicer):
    """gRPC face of a runner (``runner.Runner``: the model runner or the simulated one); steps run one
    at a time (runners are not re-entrant).

    A scheduler drives the worker over one ``Steps`` stream (``Step`` answers one plan the same
    way). With overlap it sends the next plan while the current one runs; plans run in ``step_id``
    order (numbered 0, 1, ... from the scheduler's ``Free(all)``): a plan whose predecessor has not
    arrived waits for it up to ``ORDER_WAIT_S``. A plan that arrived before the last ``Free(all)`` (a
    dead scheduler's, queued behind a pass) or whose caller is gone is refused (``STEP_STALE``;
    ``Step``: ABORTED). The gap between the end of one pass and the start of the next is reported as
    ``idle_seconds``.

    Fencing: every plan and ``Free`` carries its scheduler's fencing token (the lease's, growing with
    each takeover). The worker keeps the highest it has seen; a plan or free below it is refused
    (``STEP_FENCED``; ``Step``: FAILED_PRECONDITION; ``Free``: ``fenced``) and counted
    (``num_fenced``), so a scheduler that stalled past its lease cannot touch the blocks or publish
    tokens of the sequences a peer took over.
    """

    def __init__(self, runner, worker_id: str, model_name: str, metrics=None):
        self.runner = runner
        self.worker_id = worker_id
        self.model_name = model_name
        self.metrics = metrics
        self._lock = threading.Condition()
        self._next_step: int | None = None  # step_id expected next; None: any (no scheduler yet)
        self._last_end: float | None = None  # perf_counter at the end of the last pass
        self._epoch = 0  # Free(all) calls so far: a scheduler (re)starting its session
        self.fence = 0  # the highest fencing token seen (plans and frees below it are refused)
        self.num_fenced = 0  # plans and frees refused for a stale fence

    def _wait_turn(self, step_id: int, epoch: int) -> None:
        """With the lock held: wait until every plan numbered below ``step_id`` has run (or a
        ``Free(all)`` ended the session the plan belongs to)."""
        if self._next_step is None or step_id <= self._next_step:
            return
        ready = lambda: step_id <= self._next_step or epoch != self._epoch  # noqa: E731
        if not self._lock.wait_for(ready, timeout=ORDER_WAIT_S):
            log.warning("step %d ran without step %d (never arrived)", step_id, self._next_step)

    def Info(self, request, context):
        i = self.runner.info
        return pb.WorkerInfo(
            worker_id=self.worker_id,
            model=self.model_name,
            block_size=i.block_size,
            num_blocks=i.num_blocks,
            max_model_len=i.max_model_len,
            vocab_size=i.vocab_size,
            eos_token_ids=i.eos_token_ids,
            device=i.device,
            dtype=i.dtype,
            quantization=i.quantization or "",
            kv_cache_dtype=i.kv_cache_dtype or "",
        )

    def Step(self, request, context):
        response = self._run(convert.step_plan_from_proto(request), self._epoch, request.fence, context)
        if response.failure == pb.STEP_FENCED:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, response.error)
        if response.failure == pb.STEP_STALE:
            context.abort(grpc.StatusCode.ABORTED, response.error)
        if response.failure == pb.STEP_REJECTED:
            context.abort(grpc.StatusCode.INTERNAL, response.error)
        return response

    def Steps(self, request_iterator, context):
        """The scheduler's session: each plan read from the stream runs as ``Step`` runs it, and its
        response (or its failure) is written back. Three threads of the stream's own keep a pass off
        gRPC's path: one receives the plans while passes run (the next plan is here, read, when a pass
        ends: overlap), one runs them in turn, and this handler writes each response while the next
        pass runs. A pass therefore starts the moment the previous one ended, not after its response
        went out and the next plan was received (that took ~0.8 ms between passes on the 2-vCPU dev
        machine). The stream ending or breaking ends the session."""
        plans: queue.SimpleQueue = queue.SimpleQueue()
        responses: queue.SimpleQueue = queue.SimpleQueue()

        def receive() -> None:
            try:
                for request in request_iterator:  # the session a plan belongs to: when it arrived
                    plans.put((convert.step_plan_from_proto(request), self._epoch, request.fence))
            except grpc.RpcError:
                pass  # the scheduler went away
            finally:
                plans.put(None)

        def run() -> None:
            try:
                while (item := plans.get()) is not None:
                    responses.put(self._run(*item, context))
            finally:  # an error here ends the stream: the scheduler sees the worker as lost
                responses.put(None)

        for target, name in ((receive, "steps-in"), (run, "steps-run")):
            threading.Thread(target=target, name=name, daemon=True).start()
        while (response := responses.get()) is not None:
            yield response

    def _run(self, plan: StepPlan, epoch: int, fence: int, context) -> pb.StepResponse:
        """Run one plan in ``step_id`` order; a failure is answered with ``failure`` set. ``epoch``:
        the ``Free(all)`` count when the plan arrived (one that arrived before the last belongs to a
        scheduler that is gone); ``fence``: the plan's fencing token."""
        with self._lock:
            if fence < self.fence:  # before waiting for its turn: a fenced scheduler's numbering is void
                return self._refuse(plan.step_id, fence)
            self._wait_turn(plan.step_id, epoch)
            if fence < self.fence:
                return self._refuse(plan.step_id, fence)
            if epoch != self._epoch or not context.is_active():
                return pb.StepResponse(
                    step_id=plan.step_id, failure=pb.STEP_STALE, error="plan of a previous scheduler session"
                )
            start = time.perf_counter()
            idle = None if self._last_end is None else start - self._last_end
            try:
                result = self.runner.step(plan)
            except Exception as e:  # a bad plan must not kill the worker; the scheduler sees the error
                log.exception("step %d failed", plan.step_id)
                self._end_step(plan.step_id)
                return pb.StepResponse(
                    step_id=plan.step_id, failure=pb.STEP_REJECTED, error=f"{type(e).__name__}: {e}"
                )
            self._end_step(plan.step_id)
            free = self.runner.num_free_blocks
        time.sleep(0)  # hand the GIL to a plan queued behind this one: its pass starts now
        result.idle_seconds = idle
        if self.metrics is not None:
            self.metrics.observe_step(
                plan.num_tokens, len(result.tokens), result.forward_seconds, result.num_passes
            )
            self.metrics.observe_lora_loads(self.runner.take_lora_load_seconds())
        return convert.step_result_to_proto(result, free)

    def _refuse(self, step_id: int, fence: int) -> pb.StepResponse:
        """With the lock held: the ``STEP_FENCED`` answer to a plan with a stale ``fence``, counted."""
        self._count_fenced()
        log.warning("refused step %d of a fenced-off scheduler (fence %d < %d)", step_id, fence, self.fence)
        return pb.StepResponse(
            step_id=step_id,
            failure=pb.STEP_FENCED,
            error=f"fence {fence} is below {self.fence}: another scheduler took this worker over",
            fence=self.fence,
        )

    def _count_fenced(self) -> None:
        self.num_fenced += 1
        if self.metrics is not None:
            self.metrics.fenced.inc()

    def _end_step(self, step_id: int) -> None:
        self._last_end = time.perf_counter()
        self._next_step = step_id + 1
        self._lock.notify_all()

    def Free(self, request, context):
        with self._lock:
            if request.fence < self.fence:
                self._count_fenced()
                log.warning(
                    "refused a free of a fenced-off scheduler (fence %d < %d)", request.fence, self.fence
                )
                return pb.FreeResponse(
                    num_free_blocks=self.runner.num_free_blocks, fenced=True, fence=self.fence
                )
            self.fence = request.fence
            ids = list(self.runner.seqs) if request.all else list(request.seq_ids)
            self.runner.free(ids)
            if request.all:  # a scheduler takes over: its plans are numbered from 0
                self._epoch += 1
                self._next_step = 0
                self._last_end = None
                self._lock.notify_all()
            return pb.FreeResponse(num_free_blocks=self.runner.num_free_blocks, fence=self.fence)

    def Migrate(self, request, context):
        """Move sequences to ``request.dest_address`` (``kv_migration``): snapshot them under the lock
        (no pass runs meanwhile), stream them to the destination's ``ImportSeqs``, drop those it took."""
        with self._lock:
            if request.fence < self.fence:
                self._count_fenced()
                return pb.MigrateResponse(fenced=True, error=f"fence {request.fence} is below {self.fence}")
            snaps, errors = [], []
            for move in request.moves:
                try:
                    if not hasattr(self.runner, "export_seq"):
                        raise SchedulerError(
                            f"{type(getattr(self.runner, 'target', self.runner)).__name__} does not migrate sequences"
                        )
                    snap = self.runner.export_seq(move.seq_id)
                    snap.share_leading(move.num_shared_blocks)
                    snaps.append((snap, list(move.dest_block_ids)))
                except SchedulerError as e:
                    errors.append(str(e))
        start = time.perf_counter()
        parts = (p for snap, ids in snaps for p in kv_migration.to_parts(snap, ids, request.dest_fence))
        moved: list[int] = []
        if snaps:
            try:
                with grpc.insecure_channel(request.dest_address, options=convert.GRPC_OPTIONS) as channel:
                    answer = pb_grpc.WorkerStub(channel).ImportSeqs(parts, timeout=MIGRATE_TIMEOUT_S)
                moved = list(answer.seq_ids)
                if answer.error or answer.fenced:
                    errors.append(answer.error or "the destination refused the fence")
            except grpc.RpcError as e:
                errors.append(f"destination {request.dest_address}: {e.code().name}")
        with self._lock:
            self.runner.free(moved)
        num_bytes = sum(snap.num_bytes for snap, _ in snaps if snap.seq_id in set(moved))
        seconds = time.perf_counter() - start
        log.info(
            "migrated %d sequences (%.1f MB in %.3f s) to %s",
            len(moved),
            num_bytes / 1e6,
            seconds,
            request.dest_address,
        )
        return pb.MigrateResponse(
            moved_seq_ids=moved, num_bytes=num_bytes, seconds=seconds, error="; ".join(errors)
        )

    def ImportSeqs(self, request_iterator, context):
        """Take the sequences a source worker streams here (``kv_migration.from_parts``), each into the
        blocks the scheduler reserved, under the lock; stops at the first one refused."""
        taken: list[int] = []
        layout = kv_migration.cache_layout(self.runner)
        try:
            for snap, block_ids, fence in kv_migration.from_parts(request_iterator, *layout):
                with self._lock:
                    if fence < self.fence:
                        self._count_fenced()
                        return pb.ImportResponse(seq_ids=taken, fenced=True)
                    self.runner.import_seq(snap, block_ids)
                taken.append(snap.seq_id)
        except (SchedulerError, InvalidBlockError) as e:
            return pb.ImportResponse(seq_ids=taken, error=str(e))
        return pb.ImportResponse(seq_ids=taken)

    def Health(self, request, context):
        return pb.HealthResponse(
            ok=True,
            num_free_blocks=self.runner.num_free_blocks,
            num_running_seqs=len(self.runner.seqs),
            num_fenced=self.num_fenced,
            fence=self.fence,
            num_lora_loads=self.runner.num_lora_loads,
        )


def model_runner(args: argparse.Namespace):
    """The real runner for ``args``: ``(runner, served model name, token budget)``."""
    import torch

    from fuseserve.config import EngineConfig
    from fuseserve.model_source import resolve_model
    from fuseserve.options import from_cli_args
    from fuseserve.worker.profiler import choose_token_budget
    from fuseserve.worker.tensor_parallel import load_runner
    from fuseserve.worker.torch_thread import bind_torch_threads, torch_thread

    if args.threads:  # OpenMP's thread count is per thread: set it where the model runs
        torch_thread().call(torch.set_num_threads, args.threads)
    config = from_cli_args(EngineConfig, args)  # the engine options the worker offers
    bind_torch_threads(args.cpu_bind if config.tensor_parallel_size == 1 else "none")  # TP ranks share CPUs
    source = resolve_model(args.model, quantization=config.quantization)
    runner = load_runner(
        source.path, source.config, source.eos_token_ids(), config, config.tensor_parallel_size, args.threads
    )
    budget = config.token_budget or runner.on_thread(choose_token_budget, runner, str(source.path))
    return runner, source.name, budget


def simulated_runner(args: argparse.Namespace):
    """The ``--simulate PRESET`` runner: ``(runner, served model name, token budget)``; no torch.

    The model name is ``--model`` as given (the gateway serves that model's tokenizer). Raises
    ``InvalidParameterError`` for an unknown preset or a slowdown that is not > 0.
    """
    from fuseserve.device import parse_memory
    from fuseserve.errors import InvalidParameterError
    from fuseserve.worker.latency_model import get_preset
    from fuseserve.worker.sim_runner import SimulatedRunner

    model = get_preset(args.simulate)
    slowdown = float(args.simulate_slowdown)
    if not slowdown > 0:
        raise InvalidParameterError("simulate_slowdown", slowdown, "> 0")
    num_blocks = None
    if args.kv_cache_memory:
        num_blocks = int(parse_memory(args.kv_cache_memory) // (model.kv_bytes_per_token * args.block_size))
    runner = SimulatedRunner(model, args.block_size, num_blocks, slowdown)
    return runner, str(args.model), args.token_budget or model.knee()


def run_worker(args: argparse.Namespace) -> int:
    """Entry point of ``fuseserve worker``: serve until SIGTERM / SIGINT, then drain and exit."""
    worker_id = args.worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    runner, model_name, budget = simulated_runner(args) if args.simulate else model_runner(args)
    metrics = None
    if args.metrics_port is not None:
        metrics = WorkerMetrics(worker_id, model_name, args.metrics_port, runner)

    # a scheduler's Steps stream holds a thread while it lives (one, or two while a scheduler takes over)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=convert.GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, worker_id, model_name, metrics), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    address = f"{args.advertise_host or args.host}:{port}"
    info = runner.info
    record = messages.WorkerRecord(
        worker_id,
        address,
        model_name,
        info.block_size,
        info.num_blocks,
        info.max_model_len,
        info.vocab_size,
        info.eos_token_ids,
        budget,
        metrics.port if metrics is not None else None,
        quantization=info.quantization,
        kv_cache_dtype=info.kv_cache_dtype,
        lora_adapters=list(info.lora_adapters),
        device=info.device,
    )
    runtime_loras = runner.set_runtime_loras if args.allow_runtime_lora and not args.simulate else None
    registration = Registration(args.redis_url, worker_id, record, runtime_loras)
    registration.start()
    log.info(
        "worker %s serving %s at %s (%d KV blocks of %s, token budget %d%s)",
        worker_id,
        model_name,
        address,
        info.num_blocks,
        info.kv_cache_dtype,
        budget,
        f", simulated {args.simulate} x{runner.slowdown:g}" if args.simulate else "",
    )
    print(f"fuseserve worker {worker_id} ready at {address}", flush=True)

    drain = DrainSignal(args.drain_timeout).install()
    drain.wait_requested()
    registration.drain()
    handed_back = wait_drained(runner, drain)
    registration.stop()
    # plans still arriving are refused (they recompute elsewhere); drained clean, only an idle stream is open
    server.stop(grace=0.5 if not handed_back else 2).wait()
    log.info("worker %s drained (%d sequences handed back)", worker_id, handed_back)
    if hasattr(runner, "close"):  # a tensor-parallel runner stops its other ranks
        runner.close()
    return 0
