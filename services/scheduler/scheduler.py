"""The SplitFuse planner: builds one worker's next pass within its token budget (paper §3).

Lifecycle per worker: ``schedule_worker`` (a plan, marked in flight) → the worker runs it →
``postprocess`` (tokens, stops) or ``fail_plan``. Each worker is planned on its own, whenever it has
room for a plan; with overlap its next plan is built while the current one runs, so plans in flight
may hold tokens not known yet (``Sequence.num_pending``): such a sequence is planned as a decode
entry, fed by the worker with the token it sampled last.

Works in counts and ids only: token counts per sequence, free-block counts per worker. The
SplitFuse rules:

1. decode tokens first (one per running sequence), then continuing prompt chunks, then new prompts,
   filling the budget exactly; the last prompt taken is cut to fit;
2. a prompt is admitted only when blocks exist for its whole remaining prompt plus a watermark;
3. a running sequence that cannot get a block preempts the most recently admitted sequence
   (recompute later from prompt + generated tokens); at most ``max_preemptions`` per sequence.

A stop learned one pass late (EOS or a stop token sampled by plan N while plan N+1 already feeds
it) leaves one surplus token: it is dropped here (the sequence is finished, so no event is made)
and the sequence's blocks are freed with the worker's next plan. Length stops are never late: a
sequence whose plan in flight reaches ``max_new_tokens`` is not planned again.

With ``decode_passes > 1`` a plan of decodes only may run several passes on the worker
(multi-step decoding, ``fuseserve.scheduler.multi_pass``).

``prefill_first`` (vLLM v0, TGI before chunking) and ``whole_prompt`` (Orca) are the same machinery
with different choices (``fuseserve.scheduler.policies``).

``Scheduler`` is written in three files: this one (workers, requests, planning, preemption),
``admission.py`` (rule 2 and placement) and ``postprocess.py`` (results, failed plans); a worker's
state is ``worker_slot.WorkerSlot``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from fuseserve.block_hash import root_hash
from fuseserve.config import EngineConfig
from fuseserve.errors import ContextLengthExceededError, InvalidRequestError, SchedulerError
from fuseserve.pass_shape import PassShape
from fuseserve.scheduler import multi_pass
from fuseserve.scheduler.admission import Admission
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.policies import Draft, Policy, get_policy, schedule_decodes
from fuseserve.scheduler.postprocess import Postprocess
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.slo_budget import PassLatency, SLOBudget
from fuseserve.scheduler.worker_slot import InFlight, WorkerSlot
from fuseserve.types import SeqChunk, StepPlan, TokenEvent

__all__ = ["InFlight", "Scheduler", "TokenEvent", "WorkerSlot"]  # re-exported (engine core, policies)

log = logging.getLogger(__name__)


class Scheduler(Admission, Postprocess):
    """Plans passes for each worker and applies token-level stops.

    Args:
        config: token_budget (None → each worker's own, chosen by profiling), max_num_seqs,
            watermark_blocks, max_preemptions, policy.
        eos_token_ids: the model's EOS ids (generation config).
        clock: seconds, for TTFT deadlines (a simulation passes its simulated clock).

    ``pass_observers`` are called with ``(worker, token_budget, num_tokens)`` for every plan built:
    the budget chosen for the pass and the tokens it holds (metrics, benchmarks).
    """

    def __init__(
        self, config: EngineConfig, eos_token_ids: list[int], clock: Callable[[], float] = time.monotonic
    ):
        config.validate()
        self.config = config
        self.clock = clock
        self.slo: SLOBudget | None = None
        if config.target_itl is not None or config.target_prefill_rate is not None:
            self.slo = SLOBudget(config.target_itl, config.target_prefill_rate, clock)
        self.pass_observers: list[Callable[[str, int, int], None]] = []
        self.eos_token_ids = set(eos_token_ids)
        self.policy: Policy = get_policy(config.policy)
        self.slots: dict[str, WorkerSlot] = {}
        self._max_model_len = 1 << 30
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.seqs: dict[int, Sequence] = {}
        self._admit_counter = itertools.count()
        self.counters = SchedulerCounters()  # events since the last ``make_stats``
        self._reported = SchedulerCounters()  # the events of the records made so far
        self.model_id = ""  # part of every block hash (``fuseserve/block_hash.py``)
        self.touched: set[str] = set()  # workers given work outside their own planning (to dispatch)

    # ----- stats -----
    def make_stats(self) -> SchedulerCounters:
        """The events counted since the previous call, read and reset (``totals`` goes on)."""
        new, self.counters = self.counters, SchedulerCounters()
        self._reported.add(new)
        return new

    def totals(self) -> SchedulerCounters:
        """Every event counted so far."""
        totals = SchedulerCounters()
        totals.add(self._reported)
        totals.add(self.counters)
        return totals

    # each total so far, by its ``SchedulerCounters`` name
    num_preemptions = property(lambda self: self.totals().num_preemptions)
    num_forced_preemptions = property(lambda self: self.totals().num_forced_preemptions)
    num_surplus_tokens = property(lambda self: self.totals().num_surplus_tokens)
    num_prefix_queries = property(lambda self: self.totals().num_prefix_queries)
    num_prefix_hits = property(lambda self: self.totals().num_prefix_hits)

    # ----- workers -----
    def add_worker(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_budget: int | None = None,
        handle: Any = None,
        latency_prior: Callable[[PassShape], float] | None = None,
    ) -> WorkerSlot:
        """Register a worker's capacity. ``token_budget`` is the worker's profiled budget;
        ``latency_prior`` its start-up latency curve (``slo_budget.curve_prior``), if known.

        Raises ``SchedulerError`` when neither the config nor the worker gives a budget, or the name
        is taken.
        """
        budget = self.config.token_budget or token_budget
        if budget is None:
            raise SchedulerError(f"worker {name}: no token budget configured or profiled")
        if name in self.slots:
            raise SchedulerError(f"worker {name} is already registered")
        account = BlockAccount(num_blocks, block_size, self.config.enable_prefix_caching)
        slot = WorkerSlot(name, account, budget, max_model_len, handle)
        slot.latency = PassLatency(latency_prior)
        self.slots[name] = slot
        self._workers_changed()
        return slot

    def remove_worker(self, name: str) -> list[Sequence]:
        """Forget a lost worker; its sequences go back to the front of the queue for recompute."""
        slot = self.slots.pop(name, None)
        if slot is None:
            return []
        self._workers_changed()
        moved = list(slot.running)
        for seq in reversed(moved):
            self._to_waiting(seq)
        slot.inflight.clear()
        return moved

    # ----- requests -----
    @property
    def max_model_len(self) -> int:
        """The shortest context window of the workers, in tokens (kept as workers come and go)."""
        return self._max_model_len

    def _workers_changed(self) -> None:
        self._max_model_len = min((s.max_model_len for s in self.slots.values()), default=1 << 30)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ``ContextLengthExceededError`` / ``InvalidRequestError``."""
        if seq.seq_id in self.seqs:
            raise InvalidRequestError(f"duplicate sequence id {seq.seq_id}")
        if not seq.prompt_token_ids:
            raise InvalidRequestError("empty prompt: at least one token is required", param="prompt")
        total = seq.prompt_len + seq.params.max_new_tokens
        if total > self.max_model_len:
            raise ContextLengthExceededError(seq.prompt_len, seq.params.max_new_tokens, self.max_model_len)
        if self.slots:
            capacity = max(s.account.num_blocks - self.config.watermark_blocks for s in self.slots.values())
            block_size = next(iter(self.slots.values())).account.block_size
            if -(-total // block_size) > capacity:
                raise InvalidRequestError(
                    f"request needs {total} tokens of KV cache; a worker holds at most {capacity * block_size}",
                    param="max_tokens",
                )
        seq.status = SeqStatus.WAITING
        seq.arrival_time = self.clock()
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Finish a sequence now (client gone, stop string) and free its blocks. Unknown ids → None."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(
            s.running or s.pending_free or s.inflight for s in self.slots.values()
        )

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.slots.values())

    # ----- schedule -----
    def schedule(self) -> dict[str, StepPlan]:
        """The next plan of every worker with nothing in flight and something to do."""
        return self.schedule_workers([n for n, s in self.slots.items() if not s.inflight])

    def schedule_worker(self, name: str) -> StepPlan | None:
        """Build ``name``'s next plan and mark it in flight; None when the worker has nothing to do.

        Raises ``KeyError`` for an unknown worker.
        """
        return self.schedule_workers([name]).get(name)

    def schedule_workers(self, names: list[str]) -> dict[str, StepPlan]:
        """Build the next plan of each named worker together (admission picks among them) and mark
        the plans in flight; workers with nothing to do get none. Raises ``KeyError`` for an unknown
        worker."""
        slots = [self.slots[n] for n in names]
        drafts = self.policy.plan(self, slots)
        plans = {}
        for slot in slots:
            draft = drafts[slot.name]
            while draft.blocked and not draft.entries and not slot.inflight and slot.running:
                # every running sequence waits for a block and none may be preempted under the cap:
                # nothing would ever run again, so preempt the newest past its cap (liveness first)
                victim = max(slot.running, key=lambda s: s.admitted_at)
                log.warning("seq %d preempted past the cap to break a KV-cache deadlock", victim.seq_id)
                self.counters.num_forced_preemptions += 1
                self.preempt(slot, victim, draft)
                draft.blocked = False
                schedule_decodes(self, slot, draft)
            if not draft.entries and not slot.pending_free:
                continue
            passes = multi_pass.plan_passes(self, slot, draft)  # None: one pass (decode_passes = 1)
            hashed: list[int] = []
            chunks = [self._chunk(slot, seq, n, hashed) for seq, n in draft.entries]
            plan = StepPlan(slot.num_steps, chunks, slot.pending_free)
            if passes is not None:
                multi_pass.advance(draft, passes)
                plan.num_passes = max(passes.values())
            slot.num_steps += 1
            slot.pending_free = []
            slot.inflight.append(
                InFlight(
                    plan,
                    [(seq, n, seq.admitted_at) for seq, n in draft.entries],
                    hashed,
                    draft.num_tokens,
                    passes,
                )
            )
            plans[slot.name] = plan
            for observe in self.pass_observers:
                observe(slot.name, draft.token_budget, draft.num_tokens)
        return plans

    def new_draft(self, slot: WorkerSlot) -> Draft:
        """An empty pass for ``slot``: the fixed budget, or with latency targets and a policy sized by
        them, the budget ``SLOBudget.pass_budget`` chooses."""
        if self.slo is not None and self.policy.sized_by_slo:
            return Draft(self.slo.pass_budget(self, slot), self.config.max_num_seqs)
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
            )
        else:  # the per-step case, built positionally: no params, prompt_len 0, no prefix tokens
            chunk = SeqChunk(seq.seq_id, start, n, token_ids, sample, None, 0, block_ids, [])
        seq.num_computed_tokens = end
        if sample:
            seq.num_pending = pending + 1
        # a decode input sampled in flight is not known yet: hashing stops at the known tokens
        known = end if end < num_tokens else num_tokens
        if slot.account.needs_commit(seq.seq_id, known):
            hashed += self._commit_planned(slot, seq, known)
        return chunk

    def _commit_planned(self, slot: WorkerSlot, seq: Sequence, end: int) -> list[int]:
        """Hash the blocks of ``seq`` that its first ``end`` tokens fill (computed by the plans sent so
        far, and known); returns their ids."""
        root = root_hash(self.model_id, seq.cache_salt)
        return slot.account.commit(seq.seq_id, seq.full_block_hashes(slot.account.block_size, root), end)

    def ends_in_flight(self, seq: Sequence) -> bool:
        """The plan in flight samples ``seq``'s last token by length: planning it again is surplus."""
        return seq.num_pending > 0 and (
            len(seq.output_token_ids) + seq.num_pending >= seq.params.max_new_tokens
            or seq.num_planned_tokens >= self.max_model_len
        )

    # primitives the policies use
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
        self._to_waiting(seq)
        log.debug("preempted seq %d (%d times)", seq.seq_id, seq.num_preemptions)

    def _detach(self, seq: Sequence) -> None:
        """Take ``seq`` off its worker: release its blocks now, free them on the worker with the next plan."""
        slot = self.slots.get(seq.worker) if seq.worker else None
        if slot is not None:
            slot.account.release(seq.seq_id)
            if seq in slot.running:
                slot.running.remove(seq)
            slot.pending_free.append(seq.seq_id)
            self.touched.add(slot.name)
        seq.worker = None
        seq.num_pending = 0  # tokens of plans in flight are dropped when they arrive

    def _to_waiting(self, seq: Sequence) -> None:
        self._detach(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._detach(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
