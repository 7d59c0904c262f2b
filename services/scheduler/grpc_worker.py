"""A remote worker as an ``EngineCore`` handle: step plans over gRPC (``proto/worker.proto``).

``submit`` sends a plan without waiting for the previous one's answer (overlap): the worker runs the
plans of one scheduler in ``step_id`` order.
"""

from __future__ import annotations

from concurrent.futures import Future

import grpc

from fuseserve import messages
from fuseserve.errors import WorkerLostError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.proto import worker_pb2_grpc as pb_grpc
from fuseserve.types import StepPlan, StepResult

STEP_TIMEOUT_S = 300.0  # a pass on a slow CPU can take seconds; a hung worker is cut off after this
#: status codes that mean the worker is gone (its sequences recompute elsewhere); any other error
#: fails only the plan that caused it
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class GrpcWorker:
    """A remote worker as an ``EngineCore`` handle."""

    def __init__(self, record: messages.WorkerRecord):
        self.record = record
        self.channel = grpc.insecure_channel(record.address, options=convert.GRPC_OPTIONS)
        self.stub = pb_grpc.WorkerStub(self.channel)

    def step(self, plan: StepPlan) -> StepResult:
        """Run a plan remotely. Raises ``WorkerLostError`` when the worker cannot be reached; any other
        error (a plan the worker rejected, a value that cannot be encoded) fails only this plan."""
        request = convert.step_plan_to_proto(plan)
        try:
            msg = self.stub.Step(request, timeout=STEP_TIMEOUT_S)
        except grpc.RpcError as e:
            raise self._error(e) from e
        return convert.step_result_from_proto(msg)

    def submit(self, plan: StepPlan) -> Future:
        """Send a plan now; the future resolves to its ``StepResult``, or to ``WorkerLostError`` /
        ``RuntimeError`` as ``step`` raises them. Never blocks on the worker."""
        out: Future = Future()
        try:
            call = self.stub.Step.future(convert.step_plan_to_proto(plan), timeout=STEP_TIMEOUT_S)
        except Exception as e:  # a value that cannot be encoded fails only this plan
            out.set_exception(e)
            return out

        def done(call) -> None:
            try:
                out.set_result(convert.step_result_from_proto(call.result()))
            except grpc.RpcError as e:
                out.set_exception(self._error(e))
            except Exception as e:  # noqa: BLE001 - handed to the core as this plan's failure
                out.set_exception(e)

        call.add_done_callback(done)
        return out

    def _error(self, e: grpc.RpcError) -> Exception:
        if e.code() in LOST_CODES:
            return WorkerLostError(f"{self.record.address}: {e.code().name}")
        return RuntimeError(f"worker {self.record.worker_id}: {e.code().name}: {e.details()}")

    def reset(self) -> None:
        """Free everything the worker holds (it may have served a previous scheduler)."""
        self.stub.Free(pb.FreeRequest(all=True), timeout=10)

    def close(self) -> None:
        self.channel.close()
