"""The pass builder: one worker's next pass within its token budget (paper §3), as a ``StepPlan``.

A policy (``fuseserve.scheduler.policies``) drafts the pass: decodes, continuing prompt chunks, new
prompts admitted from the ``WaitingQueue``; with latency targets the budget of a SplitFuse pass comes
from ``slo_budget.SLOBudget``; a pass of decodes only may run several passes on the worker
(``fuseserve.scheduler.multi_pass_plan``). The builder turns the draft into chunks, advances each
sequence's planned counters, hashes the blocks the plan fills into the prefix cache, and marks the
plan in flight. It owns the preemption rule (rule 3) the policies call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fuseserve.config import EngineConfig
from fuseserve.scheduler import multi_pass_plan
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.policies import Draft, Policy, schedule_decodes
from fuseserve.scheduler.seq_lifecycle import SeqLifecycle
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.slo_budget import SLOBudget
from fuseserve.scheduler.waiting_queue import WaitingQueue
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import InFlight, WorkerSlot
from fuseserve.types import SeqChunk, StepPlan

log = logging.getLogger(__name__)


class PassBuilder:
    """Builds the plans of the workers of ``registry`` with ``policy``, admitting from ``queue``.

    slo: the latency targets' budget chooser (None: the fixed budget). ``pass_observers`` are called
    with ``(worker, token_budget, num_tokens)`` for every plan built. Preemptions are counted in
    ``counters``.
    """

    def __init__(
        self,
        config: EngineConfig,
        policy: Policy,
        slo: SLOBudget | None,
        registry: WorkerRegistry,
        queue: WaitingQueue,
        lifecycle: SeqLifecycle,
        counters: SchedulerCounters,
    ):
        self.config = config
        self.policy = policy
        self.slo = slo
        self.registry = registry
        self.queue = queue
        self.lifecycle = lifecycle
        self.counters = counters
        self.pass_observers: list[Callable[[str, int, int], None]] = []

    def build(self, names: list[str]) -> dict[str, StepPlan]:
        """Build the next plan of each named worker together (admission picks among them) and mark
        the plans in flight; workers with nothing to do get none. Raises ``KeyError`` for an unknown
        worker."""
        slots = [self.registry.slots[n] for n in names]
        drafts = self.policy.plan(self, slots)
        plans = {}
        for slot in slots:
            draft = drafts[slot.name]
            while draft.blocked and not draft.entries and not slot.inflight and slot.running:
                self._break_deadlock(slot, draft)
            if not draft.entries and not slot.pending_free:
                continue
            plans[slot.name] = self._plan(slot, draft)
            for observe in self.pass_observers:
                observe(slot.name, draft.token_budget, draft.num_tokens)
        return plans

    def _break_deadlock(self, slot: WorkerSlot, draft: Draft) -> None:
        """Every running sequence waits for a block and none may be preempted under the cap: nothing
        would ever run again, so preempt the newest past its cap (liveness first)."""
        victim = max(slot.running, key=lambda s: s.admitted_at)
        log.warning("seq %d preempted past the cap to break a KV-cache deadlock", victim.seq_id)
        self.counters.num_forced_preemptions += 1
        self.preempt(slot, victim, draft)
        draft.blocked = False
        schedule_decodes(self, slot, draft)

    def _plan(self, slot: WorkerSlot, draft: Draft) -> StepPlan:
        """``draft`` as ``slot``'s next plan, marked in flight."""
        passes = multi_pass_plan.plan_passes(  # None: one pass (decode_passes = 1)
            slot, draft, slot.decode_passes, self.registry.max_model_len, len(self.queue.waiting)
        )
        hashed: list[int] = []
        chunks = [self._chunk(slot, seq, n, hashed) for seq, n in draft.entries]
        plan = StepPlan(slot.num_steps, chunks, slot.pending_free)
        if passes is not None:
            multi_pass_plan.advance(draft, passes)
            plan.num_passes = max(passes.values())
        slot.num_steps += 1
        slot.pending_free = []
        entries = [(seq, n, seq.admitted_at) for seq, n in draft.entries]
        slot.inflight.append(InFlight(plan, entries, hashed, draft.num_tokens, passes))
        return plan

    def new_draft(self, slot: WorkerSlot) -> Draft:
        """An empty pass for ``slot``: the fixed budget, or with latency targets and a policy sized by
        them, the budget ``SLOBudget.pass_budget`` chooses."""
        if self.slo is not None and self.policy.sized_by_slo:
            budget = self.slo.pass_budget(
                slot, self.queue.waiting, len(self.registry.slots), self.registry.max_model_len
            )
            return Draft(budget, self.config.max_num_seqs)
        return Draft(slot.token_budget, self.config.max_num_seqs)

    def _chunk(self, slot: WorkerSlot, seq: Sequence, n: int, hashed: list[int]) -> SeqChunk:
        """The chunk of ``n`` tokens of ``seq`` (running on ``slot``) that comes next; advances its
        planned counters and adds to ``hashed`` the blocks it fills that enter the prefix cache."""
        start = seq.num_computed_tokens
        end = start + n
        num_out = len(seq.output_token_ids)
        pending = seq.num_pending
        num_tokens = len(seq.prompt_token_ids) + num_out
        planned = num_tokens + pending
        in_prefill = planned - start > 1 or not (num_out or pending)  # ``Sequence.in_prefill``
        # the worker feeds the token it sampled last: one sampled by a plan in flight, or one sampled
        # since admission (a recompute cut one token short of its end looks like a decode, but its
        # last token was sampled before the worker restarted it)
        decode = pending > 0 or (not in_prefill and num_tokens > seq.num_tokens_at_admission)
        sample = end == planned
        token_ids = [] if decode else seq.token_slice(start, end)
        block_ids = slot.account.unsent(seq.seq_id)
        if start == seq.num_start_tokens:  # the first chunk since admission (after its cached prefix)
            chunk = SeqChunk(
                seq_id=seq.seq_id,
                start_pos=start,
                num_tokens=n,
                token_ids=token_ids,
                sample=sample,
                params=seq.params,
                prompt_len=seq.prompt_len,
                block_ids=block_ids,
                prefix_token_ids=seq.token_slice(0, start),
                lora=seq.lora,
            )
        else:  # the per-step case, built positionally: no params, prompt_len 0, no prefix tokens
            chunk = SeqChunk(seq.seq_id, start, n, token_ids, sample, None, 0, block_ids, [])
        seq.num_computed_tokens = end
        if sample:
            seq.num_pending = pending + 1
        # a decode input sampled in flight is not known yet: hashing stops at the known tokens
        known = end if end < num_tokens else num_tokens
        if slot.account.needs_commit(seq.seq_id, known):
            hashed += slot.account.commit(
                seq.seq_id, self.queue.block_hashes(seq, slot.account.block_size), known
            )
        return chunk

    def reserve_or_preempt(self, slot: WorkerSlot, seq: Sequence, num_tokens: int, draft: Draft) -> bool:
        """Reserve blocks for ``seq`` to hold ``num_tokens``; preempt newer sequences if needed (rule 3).

        Returns False when ``seq`` cannot run this step (it was preempted itself, or no victim exists).
        """
        while not slot.account.can_reserve(seq.seq_id, num_tokens):
            victim = self._victim(slot, seq)
            if victim is None:
                return False
            self.preempt(slot, victim, draft)
            if victim is seq:
                return False
        slot.account.reserve(seq.seq_id, num_tokens)
        return True

    def _victim(self, slot: WorkerSlot, requester: Sequence) -> Sequence | None:
        cap = self.config.max_preemptions
        candidates = [s for s in slot.running if s.num_preemptions < cap]
        if not candidates:
            return None
        return max(candidates, key=lambda s: s.admitted_at)

    def preempt(self, slot: WorkerSlot, seq: Sequence, draft: Draft | None = None) -> None:
        """Free a running sequence's blocks; it recomputes later from prompt + generated tokens."""
        if draft is not None:
            draft.drop(seq)
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.lifecycle.to_waiting(seq)
        log.debug("preempted seq %d (%d times)", seq.seq_id, seq.num_preemptions)
