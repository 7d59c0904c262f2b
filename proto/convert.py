"""Conversions between the plan dataclasses (``fuseserve.types``, ``fuseserve.sampling_params``) and
the gRPC messages of ``proto/worker.proto``, both ways.

The scheduler builds a :class:`~fuseserve.types.StepPlan` and sends ``step_plan_to_proto(plan)``; the
worker turns it back with :func:`step_plan_from_proto`, runs it, and answers with
``step_result_to_proto(result, num_free_blocks)``. Each ``*_from_proto(*_to_proto(x)) == x``.
"""

from __future__ import annotations

import dataclasses

from fuseserve.proto import worker_pb2 as pb
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import PromptLogprobs, SampledToken, SeqChunk, StepPlan, StepResult, TokenLogprob


# ---------------------------------------------------------------------------------- SamplingParams
def _param_fields() -> list[tuple[str, object]]:
    """``(name, proto field descriptor)`` of every ``SamplingParams`` field: the proto message mirrors
    the dataclass by name, so a field added to both travels without an edit here."""
    by_name = pb.SamplingParams.DESCRIPTOR.fields_by_name
    missing = [f.name for f in dataclasses.fields(SamplingParams) if f.name not in by_name]
    if missing:
        raise TypeError(f"proto SamplingParams lacks field(s) {missing}; add them to worker.proto")
    return [(f.name, by_name[f.name]) for f in dataclasses.fields(SamplingParams)]


def _is_map(fd) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """SamplingParams → ``fuseserve.worker.v1.SamplingParams``: repeated and map fields from lists
    and dicts, None left unset on ``optional`` fields, scalars as they are."""
    msg = pb.SamplingParams()
    for name, fd in _param_fields():
        value = getattr(params, name)
        if _is_map(fd):
            getattr(msg, name).update(value or {})
        elif fd.is_repeated:
            getattr(msg, name).extend(value or [])
        elif value is not None:
            setattr(msg, name, value)
    return msg


#: channel / server options shared by both ends of the contract (plans of long prompts can be large)
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """``fuseserve.worker.v1.SamplingParams`` → SamplingParams (unset ``optional`` fields become None).

    Built with ``SamplingParams(**fields)``; not re-validated (the gateway validated it already).
    """
    fields: dict[str, object] = {}
    nullable = {f.name for f in dataclasses.fields(SamplingParams) if f.default is None}
    for name, fd in _param_fields():
        if _is_map(fd):
            fields[name] = dict(getattr(msg, name))
        elif fd.is_repeated:  # empty means None where None is the default (``choice``)
            fields[name] = list(getattr(msg, name)) or (None if name in nullable else [])
        elif fd.has_presence:
            fields[name] = getattr(msg, name) if msg.HasField(name) else None
        else:
            fields[name] = getattr(msg, name)
    return SamplingParams(**fields)


# ---------------------------------------------------------------------------------------- StepPlan
# The scheduler encodes a plan and decodes a result per worker-step: messages are built in place
# (``chunks.add``) and a field is set only when it has a value (a decode entry: four scalars and the
# block it may start); about 2x faster than building every message with every field.
def _add_chunk(chunks, chunk: SeqChunk) -> None:
    """Append ``chunk`` to a ``repeated SeqChunk`` field; ``params`` is sent only when set."""
    msg = chunks.add(
        seq_id=chunk.seq_id, start_pos=chunk.start_pos, num_tokens=chunk.num_tokens, sample=chunk.sample
    )
    if chunk.block_ids:
        msg.block_ids.extend(chunk.block_ids)
    if chunk.token_ids:
        msg.token_ids.extend(chunk.token_ids)
    if chunk.params is not None:
        msg.params.CopyFrom(sampling_params_to_proto(chunk.params))
    if chunk.prompt_len:
        msg.prompt_len = chunk.prompt_len
    if chunk.prefix_token_ids:
        msg.prefix_token_ids.extend(chunk.prefix_token_ids)
    if chunk.lora is not None:
        msg.lora_name = chunk.lora


def seq_chunk_to_proto(chunk: SeqChunk) -> pb.SeqChunk:
    """SeqChunk → ``SeqChunk`` message; ``params`` is sent only when set (first chunk)."""
    holder = pb.StepRequest()
    _add_chunk(holder.chunks, chunk)
    return holder.chunks[0]


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
        block_ids=list(msg.block_ids),
        prefix_token_ids=list(msg.prefix_token_ids),
        lora=msg.lora_name if msg.HasField("lora_name") else None,
    )


def step_plan_to_proto(plan: StepPlan) -> pb.StepRequest:
    """StepPlan → ``StepRequest`` (chunks in plan order)."""
    msg = pb.StepRequest(step_id=plan.step_id, free_seq_ids=plan.free_seq_ids, num_passes=plan.num_passes)
    chunks = msg.chunks
    for chunk in plan.chunks:
        _add_chunk(chunks, chunk)
    return msg


def step_plan_from_proto(msg: pb.StepRequest) -> StepPlan:
    """``StepRequest`` → StepPlan."""
    return StepPlan(
        step_id=msg.step_id,
        chunks=[seq_chunk_from_proto(c) for c in msg.chunks],
        free_seq_ids=list(msg.free_seq_ids),
        num_passes=max(1, msg.num_passes),
    )


# -------------------------------------------------------------------------------------- StepResult
def sampled_token_to_proto(token: SampledToken) -> pb.SampledToken:
    """SampledToken → ``SampledToken`` message (``logprob`` unset when None)."""
    msg = pb.SampledToken(
        seq_id=token.seq_id,
        token_id=token.token_id,
        top_logprobs=_logprobs_to_proto(token.top_logprobs),
    )
    if token.logprob is not None:
        msg.logprob = token.logprob
    return msg


def sampled_token_from_proto(msg: pb.SampledToken) -> SampledToken:
    """``SampledToken`` message → SampledToken (``logprob`` None when unset)."""
    if not msg.HasField("logprob"):  # no logprobs asked: no alternatives either
        return SampledToken(msg.seq_id, msg.token_id)
    return SampledToken(
        seq_id=msg.seq_id,
        token_id=msg.token_id,
        logprob=msg.logprob if msg.HasField("logprob") else None,
        top_logprobs=_logprobs_from_proto(msg.top_logprobs),
    )


def step_result_to_proto(result: StepResult, num_free_blocks: int = 0) -> pb.StepResponse:
    """StepResult → ``StepResponse``; ``num_free_blocks`` is the worker's free KV blocks after the pass."""
    return pb.StepResponse(
        step_id=result.step_id,
        tokens=[sampled_token_to_proto(t) for t in result.tokens],
        forward_seconds=result.forward_seconds,
        num_free_blocks=num_free_blocks,
        idle_seconds=result.idle_seconds,
        prompt_logprobs=[
            pb.PromptLogprobs(
                seq_id=p.seq_id,
                start_pos=p.start_pos,
                logprobs=p.logprobs,
                top=[pb.TopLogprobs(entries=_logprobs_to_proto(t)) for t in p.top],
            )
            for p in result.prompt_logprobs
        ],
        num_passes=result.num_passes,
    )


def step_result_from_proto(msg: pb.StepResponse) -> StepResult:
    """``StepResponse`` → StepResult (read ``msg.num_free_blocks`` for the worker's free blocks)."""
    return StepResult(
        step_id=msg.step_id,
        tokens=[sampled_token_from_proto(t) for t in msg.tokens],
        forward_seconds=msg.forward_seconds,
        idle_seconds=msg.idle_seconds if msg.HasField("idle_seconds") else None,
        prompt_logprobs=[
            PromptLogprobs(
                p.seq_id, p.start_pos, list(p.logprobs), [_logprobs_from_proto(t.entries) for t in p.top]
            )
            for p in msg.prompt_logprobs
        ]
        if msg.prompt_logprobs
        else [],
        num_passes=max(1, msg.num_passes),
    )


def _logprobs_to_proto(entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in entries]


def _logprobs_from_proto(entries) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in entries]
