"""Multi-step scheduling: one plan of K decode passes (vLLM v0's ``--num-scheduler-steps``).

Every plan costs the scheduler a plan, a round trip, a postprocess and a publish. When a worker's
pass holds decodes only and nothing waits to be placed, ``plan_passes`` lets the plan run up to
``EngineConfig.decode_passes`` passes on the worker, which feeds each sequence its own sampled
tokens (``services/worker/multi_pass_run.py``). Rules:

- only when the waiting queue is empty and no sequence of the worker has prompt tokens left, so a
  SplitFuse admission is never delayed by more than the passes already in flight;
- the plan's passes end with the first sequence that ends by length (``max_new_tokens`` or the
  context window): in a closed loop the next request arrives as one finishes, and is then not
  delayed by passes planned past that point;
- blocks for every pass are reserved now (they ride on the plan's chunks); when the free blocks are
  short the plan takes fewer passes, down to one: never a preemption for multi-step;
- a sequence's counters advance by all its passes (``num_computed_tokens``, ``num_pending``), so
  the overlap plan built while it runs starts after them;
- the result's tokens are applied pass by pass (``ResultApplier``, ``result_applier.py``); tokens
  after a stop are surplus (dropped, never sent, never counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fuseserve.scheduler.policies import Draft
    from fuseserve.scheduler.worker_slot import WorkerSlot


def plan_passes(
    slot: WorkerSlot, draft: Draft, decode_passes: int, max_model_len: int, num_waiting: int
) -> dict[int, int] | None:
    """Passes per sequence id for ``draft`` (before its chunks are built), blocks reserved; None: one pass.

    ``decode_passes``: the most passes a plan may take (``EngineConfig.decode_passes``);
    ``max_model_len``: the context window; ``num_waiting``: sequences in the waiting queue.

    The plan ends with the first sequence that ends by length (its ``max_new_tokens`` or the context
    window): a closed-loop client sends its next request when one finishes, so the pass that admits
    it is not delayed; a simulated closed loop (scale_out's shape) keeps the one-pass timeline.
    """
    k = decode_passes
    if k <= 1 or not draft.entries or num_waiting:
        return None
    if any(n != 1 or seq.in_prefill for seq, n in draft.entries):
        return None
    if any(seq.in_prefill for seq in slot.running):  # a prompt chunk is still to run
        return None
    for seq, _ in draft.entries:  # tokens this plan may sample for ``seq`` before a length stop
        k = min(
            k,
            max_model_len - seq.num_planned_tokens,
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
