"""Multi-step scheduling: one plan of K decode passes (vLLM v0's ``--num-scheduler-steps``).

Every plan costs the scheduler a plan, a round trip, a postprocess and a publish. When a worker's
pass holds decodes only and nothing waits to be placed, ``plan_passes`` lets the plan run up to
``EngineConfig.decode_passes`` passes on the worker, which feeds each sequence its own sampled
tokens (``services/worker/multi_pass_run.py``). Rules:

- only when the waiting queue is empty and no sequence of the worker has prompt tokens left, so a
  SplitFuse admission is never delayed by more than the passes already in flight;
- not while a plan with a prompt chunk is in flight (the plan built during a prefill): requests
  arrive in bursts, and the first of one ran alone while the rest were still reaching the queue
  (served, 16 clients starting at once: the 15 others waited behind K passes of the first);
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


CPU_WORKER_DECODE_PASSES = 3
"""``decode_passes`` of a worker process on a CPU when ``EngineConfig.decode_passes`` is None.

There the gateway, the scheduler, Redis (and often the clients) run on the cores the worker's
intra-op threads use, and a thread taken off its core mid-pass stalls its partner at the next
barrier: on 2 vCPUs the worker's two threads waited ~1 s on the run queue in a 4.8-s served run,
about the CPU the other processes used. Fewer plans mean fewer wake-ups: served bf16 SmolLM2, 32
requests from 16 clients, K = 1 / 4 alternated three times: 1471.7 / 1544.6, 1429.2 / 1543.4,
1459.0 / 1510.5 tok/s, TTFT mean 0.45-0.47 / 0.49-0.51 s, ITL p95 0.113-0.131 / 0.122-0.136 s;
then, with a prompt chunk in flight keeping plans to one pass, K = 3 / 4 alternated twice: 1597.6 /
1637.3, 1636.9 / 1594.8 tok/s, ITL p95 0.115, 0.117 / 0.124, 0.116 s (``benchmarks/README.md``).
Tokens reach a stream in bursts of up to K, and a p95 inter-token latency of about K passes, so the
smaller K of the same throughput. In process (the pipeline) the scheduler runs between passes on the
same thread and the same runs were unchanged (2474 / 2560, 2473 / 2450 tok/s), so there it stays 1,
as on GPUs (not measured there)."""


def default_decode_passes(device: str | None) -> int:
    """Decode passes per plan for a worker on ``device`` (``WorkerInfo.device``: ``cpu``, ``cuda:0``,
    ``simulated``; None: the in-process pipeline's runner) when the config leaves it open:
    ``CPU_WORKER_DECODE_PASSES`` for ``cpu``, else 1."""
    return CPU_WORKER_DECODE_PASSES if device == "cpu" else 1


def plan_passes(
    slot: WorkerSlot, draft: Draft, decode_passes: int, max_model_len: int, num_waiting: int
) -> dict[int, int] | None:
    """Passes per sequence id for ``draft`` (before its chunks are built), blocks reserved; None: one pass.

    ``decode_passes``: the most passes a plan may take (the slot's, ``WorkerSlot.decode_passes``);
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
    if any(c.token_ids for f in slot.inflight for c in f.plan.chunks):
        return None  # a prompt chunk is running: requests come in bursts, the rest of one may be on its way
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
