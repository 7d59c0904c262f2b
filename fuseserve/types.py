"""Plain data types crossing the scheduler ↔ worker boundary (in-process or over gRPC).

A step plan carries ids and counts, never tensors. The worker keeps
each sequence's block table, sampling state and last sampled token, so a decode entry needs no
token id. ``fuseserve/proto/worker.proto`` mirrors these types field for field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fuseserve.sampling_params import SamplingParams


@dataclass
class SeqChunk:
    """One sequence's slice of a forward pass.

    seq_id: engine-wide unique sequence id.
    start_pos: position (0-based) of the first token of this chunk; equals the number of tokens
        whose KV the worker already holds for the sequence.
    num_tokens: tokens in this chunk (>= 1).
    token_ids: the chunk's token ids when they are known to the scheduler (prompt chunks, or a
        recompute after preemption); empty for a decode entry, where the worker feeds the token it
        sampled last for this sequence (then ``num_tokens == 1``).
    sample: True when the chunk reaches the end of the known tokens, so the pass samples a token.
    params: sampling parameters, sent with the sequence's first chunk only (``start_pos == 0``).
    prompt_len: number of prompt tokens (for penalties: prompt vs generated), with ``params``.
    block_ids: KV-block ids appended to the sequence's block table before the chunk runs (the
        scheduler allocates every block, ``services/scheduler/block_accounting.py``); with ``params``
        they start a new table, whose first blocks may be shared cached blocks (prefix cache hit).
    prefix_token_ids: with ``params`` and ``start_pos > 0``: the tokens ``0..start_pos`` whose K/V
        are already in the table's shared blocks (not computed again; kept for penalties).
    lora: with ``params``: the name of the LoRA adapter the sequence runs with (one of the worker's
        ``lora_modules``); None: the base model.
    """

    seq_id: int
    start_pos: int
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    sample: bool = False
    params: SamplingParams | None = None
    prompt_len: int = 0
    block_ids: list[int] = field(default_factory=list)
    prefix_token_ids: list[int] = field(default_factory=list)
    lora: str | None = None


@dataclass
class StepPlan:
    """One forward pass for one worker: chunks to run, then sequences to free.

    free_seq_ids are released *before* the chunks run (their blocks become usable by this step).
    num_passes: decode passes to run (multi-step scheduling, ``services/worker/multi_pass_run.py``); > 1
        only when every chunk is a decode entry (``num_tokens == 1``, ``sample``) whose ``block_ids``
        cover all its passes. Each later pass feeds every sequence the token it sampled last; a
        sequence stops taking passes once it reaches ``max_new_tokens`` or samples a stop token
        (EOS unless ``ignore_eos``, or one of ``stop_token_ids``, past ``min_new_tokens``).
    """

    step_id: int
    chunks: list[SeqChunk] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)
    num_passes: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens in the pass (the quantity the token budget bounds)."""
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class TokenLogprob:
    """Log-probability of a token id (natural log, over the full vocabulary, before sampling knobs)."""

    token_id: int
    logprob: float


@dataclass
class SampledToken:
    """A token sampled for one sequence in one step."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens of one sequence, computed by one pass.

    start_pos: prompt position of the first entry (>= 1). logprobs: per position, the prompt
    token's logprob. top: per position, the top-N alternatives (N = ``params.prompt_logprobs``).
    """

    seq_id: int
    start_pos: int
    logprobs: list[float] = field(default_factory=list)
    top: list[list[TokenLogprob]] = field(default_factory=list)


@dataclass
class StepResult:
    """What a worker returns for a StepPlan: one SampledToken per chunk with ``sample=True``, in plan
    order; with ``num_passes > 1``, those of every pass in pass order (per pass, plan order).

    forward_seconds: wall seconds of the pass on the worker (prepare + forward + sample); of all its
        passes together for a multi-pass plan.
    idle_seconds: seconds the worker waited for this plan after its previous pass ended; None when
        not measured (an in-process runner, or the first pass after a reset).
    prompt_logprobs: prompt-token logprobs computed by the pass (sequences that asked for them).
    """

    step_id: int
    tokens: list[SampledToken] = field(default_factory=list)
    forward_seconds: float = 0.0
    idle_seconds: float | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    num_passes: int = 1  # forward passes the worker ran for the plan (<= the plan's num_passes)


class FinishReason(enum.Enum):
    """Why a sequence ended (the OpenAI ``finish_reason`` values fuseserve produces)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context window reached
    ABORT = "abort"  # the client went away or asked to cancel


@dataclass
class TokenEvent:
    """A token produced for a sequence by the engine core; ``finish_reason`` set on its last event.

    hidden: the token ended the sequence as EOS / a stop token id and is not part of the text.
    error: why the sequence failed (with ``finish_reason`` ABORT), e.g. the worker rejected its step;
    error_status: the HTTP status that error maps to (500 engine failure, 503 no worker, 4xx a
    request the scheduler refused); error_type: OpenAI's error ``type`` (None: from the status).
    index: the token's position in the sequence's output (-1 without a token), fixed when the token is
    applied: one poll may apply several results of a sequence, so it cannot be read off later.
    prompt_logprobs: prompt-token logprobs (an event without a token); a recompute may resend
    positions already sent.
    cached_tokens: on the first token's event (index 0), the prompt tokens found in the prefix cache
        (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); 0 on every other event.
    fence: the request's fencing token in the persistent stack (its Redis entry's delivery count
        once a scheduler took it over from another; 0 before). The gateway drops events whose fence
        is below one it has seen for the request: they come from a scheduler it was taken from.
    """

    seq_id: int
    token: SampledToken | None
    finish_reason: FinishReason | None = None
    hidden: bool = False
    error: str | None = None
    error_status: int = 500
    index: int = -1
    prompt_logprobs: PromptLogprobs | None = None
    cached_tokens: int = 0
    error_type: str | None = None
    fence: int = 0

    def error_info(self) -> dict | None:
        """The error as the gateway reports it: ``{"message", "type", "status"}``, or None."""
        if self.error is None:
            return None
        return {
            "message": self.error,
            "type": self.error_type or _status_type(self.error_status),
            "status": self.error_status,
        }

    def to_wire(self) -> dict:
        """The event as the scheduler publishes it to a gateway's Redis stream (a JSON object):
        ``{"seq_id", "index", "token_id"}`` for a plain token, the other fields only when they are
        not at their default (``logprob``, ``top_logprobs`` ``[[token_id, logprob], ...]``, ``hidden``,
        ``finish_reason`` as its string, ``cached_tokens``, ``prompt_logprobs`` ``{"start_pos",
        "logprobs", "top"}``, ``error`` as ``error_info()``, ``fence``). Built straight from the fields: it runs
        once per token on the scheduler's loop."""
        tok = self.token
        if tok is None:
            wire: dict = (
                {"seq_id": self.seq_id} if self.index == -1 else {"seq_id": self.seq_id, "index": self.index}
            )
        else:
            wire = {"seq_id": self.seq_id, "index": self.index, "token_id": tok.token_id}
            if tok.logprob is not None:
                wire["logprob"] = tok.logprob
            if tok.top_logprobs:
                wire["top_logprobs"] = [[t.token_id, t.logprob] for t in tok.top_logprobs]
        if self.hidden:
            wire["hidden"] = True
        if self.finish_reason is not None:
            wire["finish_reason"] = self.finish_reason.value
        if self.cached_tokens:
            wire["cached_tokens"] = self.cached_tokens
        if self.prompt_logprobs is not None:
            p = self.prompt_logprobs
            top = [[[t.token_id, t.logprob] for t in alts] for alts in p.top]
            wire["prompt_logprobs"] = {"start_pos": p.start_pos, "logprobs": list(p.logprobs), "top": top}
        if self.error is not None:
            wire["error"] = self.error_info()
        if self.fence:
            wire["fence"] = self.fence
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> TokenEvent:
        """The event of a ``to_wire`` dict (the gateway's side of the Redis stream)."""
        seq_id = wire["seq_id"]
        token_id = wire.get("token_id")
        token = None
        if token_id is not None:
            top = [TokenLogprob(int(t), float(lp)) for t, lp in wire.get("top_logprobs", ())]
            token = SampledToken(seq_id, token_id, wire.get("logprob"), top)
        finish = wire.get("finish_reason")
        prompt = wire.get("prompt_logprobs")
        if prompt is not None:
            top = [[TokenLogprob(int(t), float(lp)) for t, lp in alts] for alts in prompt["top"]]
            prompt = PromptLogprobs(seq_id, prompt["start_pos"], list(prompt["logprobs"]), top)
        error = wire.get("error")
        status = int(error.get("status") or 500) if error else 500
        kind = error.get("type") if error else None
        return cls(
            seq_id,
            token,
            FinishReason(finish) if finish is not None else None,
            hidden=wire.get("hidden", False),
            error=error["message"] if error else None,
            error_status=status,
            index=wire.get("index", -1),
            prompt_logprobs=prompt,
            cached_tokens=wire.get("cached_tokens", 0),
            error_type=None if kind == _status_type(status) else kind,  # None: the status's own
            fence=wire.get("fence", 0),
        )


def _status_type(status: int) -> str:
    """OpenAI's error ``type`` of an engine error with HTTP ``status`` (503: no worker)."""
    return "service_unavailable" if status == 503 else "server_error"
