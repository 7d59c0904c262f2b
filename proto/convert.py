"""Conversions between the plan dataclasses (``fuseserve.types``, ``fuseserve.sampling_params``) and
the gRPC messages of ``proto/worker.proto``, both ways.

The scheduler builds a :class:`~fuseserve.types.StepPlan` and sends ``step_plan_to_proto(plan)``; the
worker turns it back with :func:`step_plan_from_proto`, runs it, and answers with
``step_result_to_proto(result, num_free_blocks)``. Each ``*_from_proto(*_to_proto(x)) == x``.
"""

from __future__ import annotations

from fuseserve.proto import worker_pb2 as pb
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SampledToken, SeqChunk, StepPlan, StepResult, TokenLogprob

_PARAM_SCALARS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
)
"""SamplingParams fields that are plain proto3 scalars (always present on the wire)."""

_PARAM_OPTIONALS = ("seed", "logprobs", "json_schema", "regex", "grammar")
"""SamplingParams fields where None matters: proto3 ``optional``, unset on the wire means None."""

_PARAM_LISTS = ("stop", "stop_token_ids")
"""SamplingParams fields that are repeated on the wire (lists in Python)."""


# ---------------------------------------------------------------------------------- SamplingParams
def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """SamplingParams → ``fuseserve.worker.v1.SamplingParams`` (None optionals stay unset)."""
    msg = pb.SamplingParams()
    for name in _PARAM_SCALARS:
        setattr(msg, name, getattr(params, name))
    for name in _PARAM_OPTIONALS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    for name in _PARAM_LISTS:
        getattr(msg, name).extend(getattr(params, name))
    msg.choice.extend(params.choice or [])
    msg.logit_bias.update(params.logit_bias)
    return msg


#: channel / server options shared by both ends of the contract (plans of long prompts can be large)
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """``fuseserve.worker.v1.SamplingParams`` → SamplingParams (unset optionals become None).

    Built with ``SamplingParams(**fields)``; not re-validated (the gateway validated it already).
    """
    fields: dict[str, object] = {name: getattr(msg, name) for name in _PARAM_SCALARS}
    for name in _PARAM_OPTIONALS:
        fields[name] = getattr(msg, name) if msg.HasField(name) else None
    for name in _PARAM_LISTS:
        fields[name] = list(getattr(msg, name))
    fields["choice"] = list(msg.choice) or None
    fields["logit_bias"] = dict(msg.logit_bias)
    return SamplingParams(**fields)


# ---------------------------------------------------------------------------------------- StepPlan
def seq_chunk_to_proto(chunk: SeqChunk) -> pb.SeqChunk:
    """SeqChunk → ``SeqChunk`` message; ``params`` is sent only when set (first chunk)."""
    msg = pb.SeqChunk(
        seq_id=chunk.seq_id,
        start_pos=chunk.start_pos,
        num_tokens=chunk.num_tokens,
        token_ids=chunk.token_ids,
        sample=chunk.sample,
        prompt_len=chunk.prompt_len,
    )
    if chunk.params is not None:
        msg.params.CopyFrom(sampling_params_to_proto(chunk.params))
    return msg


def seq_chunk_from_proto(msg: pb.SeqChunk) -> SeqChunk:
    """``SeqChunk`` message → SeqChunk (``params`` is None when the message carries none)."""
    return SeqChunk(
        seq_id=msg.seq_id,
        start_pos=msg.start_pos,
        num_tokens=msg.num_tokens,
        token_ids=list(msg.token_ids),
        sample=msg.sample,
        params=sampling_params_from_proto(msg.params) if msg.HasField("params") else None,
        prompt_len=msg.prompt_len,
    )


def step_plan_to_proto(plan: StepPlan) -> pb.StepRequest:
    """StepPlan → ``StepRequest`` (chunks in plan order)."""
    return pb.StepRequest(
        step_id=plan.step_id,
        chunks=[seq_chunk_to_proto(c) for c in plan.chunks],
        free_seq_ids=plan.free_seq_ids,
    )


def step_plan_from_proto(msg: pb.StepRequest) -> StepPlan:
    """``StepRequest`` → StepPlan."""
    return StepPlan(
        step_id=msg.step_id,
        chunks=[seq_chunk_from_proto(c) for c in msg.chunks],
        free_seq_ids=list(msg.free_seq_ids),
    )


# -------------------------------------------------------------------------------------- StepResult
def sampled_token_to_proto(token: SampledToken) -> pb.SampledToken:
    """SampledToken → ``SampledToken`` message (``logprob`` unset when None)."""
    msg = pb.SampledToken(
        seq_id=token.seq_id,
        token_id=token.token_id,
        top_logprobs=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in token.top_logprobs],
    )
    if token.logprob is not None:
        msg.logprob = token.logprob
    return msg


def sampled_token_from_proto(msg: pb.SampledToken) -> SampledToken:
    """``SampledToken`` message → SampledToken (``logprob`` None when unset)."""
    return SampledToken(
        seq_id=msg.seq_id,
        token_id=msg.token_id,
        logprob=msg.logprob if msg.HasField("logprob") else None,
        top_logprobs=[TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in msg.top_logprobs],
    )


def step_result_to_proto(result: StepResult, num_free_blocks: int = 0) -> pb.StepResponse:
    """StepResult → ``StepResponse``; ``num_free_blocks`` is the worker's free KV blocks after the pass."""
    return pb.StepResponse(
        step_id=result.step_id,
        tokens=[sampled_token_to_proto(t) for t in result.tokens],
        forward_seconds=result.forward_seconds,
        num_free_blocks=num_free_blocks,
        idle_seconds=result.idle_seconds,
    )


def step_result_from_proto(msg: pb.StepResponse) -> StepResult:
    """``StepResponse`` → StepResult (read ``msg.num_free_blocks`` for the worker's free blocks)."""
    return StepResult(
        step_id=msg.step_id,
        tokens=[sampled_token_from_proto(t) for t in msg.tokens],
        forward_seconds=msg.forward_seconds,
        idle_seconds=msg.idle_seconds if msg.HasField("idle_seconds") else None,
    )
