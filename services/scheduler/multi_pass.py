"""Multi-step scheduling: one plan of K decode passes (vLLM v0's ``--num-scheduler-steps``).

Every plan costs the scheduler a plan, a round trip, a postprocess and a publish. When a worker's
pass holds decodes only and nothing waits to be placed, ``plan_passes`` lets the plan run up to
``EngineConfig.decode_passes`` passes on the worker, which feeds each sequence its own sampled
tokens (``services/worker/multi_pass.py``). Rules:

- only when the waiting queue is empty and no sequence of the worker has prompt tokens left, so a
  SplitFuse admission is never delayed by more than the passes already in flight;
- the plan's passes end with the first sequence that ends by length (``max_new_tokens`` or the
  context window): in a closed loop the next request arrives as one finishes, and is then not
  delayed by passes planned past that point;
- blocks for every pass are reserved now (they ride on the plan's chunks); when the free blocks are
  short the plan takes fewer passes, down to one: never a preemption for multi-step;
- a sequence's counters advance by all its passes (``num_computed_tokens``, ``num_pending``), so
  the overlap plan built while it runs starts after them;
- ``apply_passes`` applies the tokens pass by pass; tokens after a stop are surplus (dropped, never
  sent, never counted).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from fuseserve.scheduler.sequence import FinishReason, SeqStatus
from fuseserve.stop_rule import check_stop
from fuseserve.types import StepResult, TokenEvent

if TYPE_CHECKING:
    from fuseserve.scheduler.policies import Draft
    from fuseserve.scheduler.scheduler import InFlight, Scheduler, WorkerSlot

log = logging.getLogger(__name__)


def plan_passes(sched: Scheduler, slot: WorkerSlot, draft: Draft) -> dict[int, int] | None:
    """Passes per sequence id for ``draft`` (before its chunks are built), blocks reserved; None: one pass.

    The plan ends with the first sequence that ends by length (its ``max_new_tokens`` or the context
    window): a closed-loop client sends its next request when one finishes, so the pass that admits
    it is not delayed; a simulated closed loop (scale_out's shape) keeps the one-pass timeline.
    """
    k = sched.config.decode_passes
    if k <= 1 or not draft.entries or sched.waiting:
        return None
    if any(n != 1 or seq.in_prefill for seq, n in draft.entries):
        return None
    if any(seq.in_prefill for seq in slot.running):  # a prompt chunk is still to run
        return None
    for seq, _ in draft.entries:  # tokens this plan may sample for ``seq`` before a length stop
        k = min(
            k,
            sched.max_model_len - seq.num_planned_tokens,
            seq.params.max_new_tokens - len(seq.output_token_ids) - seq.num_pending,
        )
    account = slot.account
    while k > 1:
        # schedule_decodes reserved the first pass's token; the later passes need the rest
        need = sum(
            account.extra_needed(seq.seq_id, seq.num_planned_tokens + k - 1) for seq, _ in draft.entries
        )
        if need <= account.num_free:
            for seq, _ in draft.entries:
                account.reserve(seq.seq_id, seq.num_planned_tokens + k - 1)
            return {seq.seq_id: k for seq, _ in draft.entries}
        k -= 1  # blocks are short: fewer passes, never a preemption
    return None


def advance(draft: Draft, passes: dict[int, int]) -> None:
    """After the chunks are built (one token each): count the later passes' tokens as planned."""
    for seq, _ in draft.entries:
        extra = passes[seq.seq_id] - 1
        seq.num_computed_tokens += extra
        seq.num_pending += extra


def apply_passes(sched: Scheduler, worker: str, record: InFlight, result: StepResult) -> list[TokenEvent]:
    """Apply a multi-pass result: each sequence's tokens in pass order, with the token-level stops.

    Tokens after a stop, and tokens of sequences finished since the plan was sent, are surplus. A
    live sequence that got fewer tokens than planned without a stop (the worker stopped it by a
    rule the scheduler does not share) recomputes: its counters expect every planned token.
    """
    by_seq: dict[int, list] = collections.defaultdict(list)
    for t in result.tokens:
        by_seq[t.seq_id].append(t)
    events = []
    for seq, _, admitted_at in record.entries:
        toks = by_seq.get(seq.seq_id, ())
        if not sched._live(seq, worker, admitted_at):
            if seq.status is SeqStatus.FINISHED:
                sched.counters.num_surplus_tokens += len(toks)
            continue
        for i, tok in enumerate(toks):
            seq.num_pending -= 1
            seq.output_token_ids.append(tok.token_id)
            num_output = len(seq.output_token_ids)
            reason = check_stop(
                seq.params, tok.token_id, num_output, seq.num_tokens, sched.eos_token_ids, sched.max_model_len
            )
            index = num_output - 1
            cached = (seq.num_cached_tokens or 0) if index == 0 else 0
            hidden = reason is FinishReason.STOP
            events.append(TokenEvent(seq.seq_id, tok, reason, hidden, index=index, cached_tokens=cached))
            if reason is not None:
                sched._finish(seq, reason)
                sched.counters.num_surplus_tokens += len(toks) - i - 1
                break
        else:
            if len(toks) < record.passes[seq.seq_id]:
                log.warning(
                    "seq %d: %d of %d planned tokens came back without a stop; recomputing",
                    seq.seq_id,
                    len(toks),
                    record.passes[seq.seq_id],
                )
                sched._to_waiting(seq)
    return events
