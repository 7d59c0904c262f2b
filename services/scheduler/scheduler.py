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
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fuseserve.block_hash import root_hash
from fuseserve.config import EngineConfig
from fuseserve.errors import ContextLengthExceededError, InvalidRequestError, SchedulerError
from fuseserve.scheduler import multi_pass
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.placement import StepTimeModel, near_least_loaded, seconds_per_share
from fuseserve.scheduler.policies import Draft, Policy, get_policy, schedule_decodes
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.slo_budget import PassLatency, SLOBudget
from fuseserve.types import SeqChunk, StepPlan, StepResult, TokenEvent
from fuseserve.worker.latency_model import PassShape

log = logging.getLogger(__name__)


@dataclass
@dataclass
class InFlight:
    """A plan sent to a worker and not answered yet.

    entries: ``(sequence, num_tokens, admitted_at)``; a result applies to a sequence only while it is
    still running on that worker under the same admission (not preempted, moved or finished since).
    hashed: blocks this plan fills that were added to the prefix cache when it was built.
    passes: with ``plan.num_passes > 1``, the passes planned per sequence id (``multi_pass.py``).
    """

    plan: StepPlan
    entries: list[tuple[Sequence, int, int]]
    hashed: list[int] = field(default_factory=list)
    passes: dict[int, int] | None = None


@dataclass
class WorkerSlot:
    """One worker as the engine sees it: capacity, running sequences, plans in flight, its handle.

    handle: how plans reach the worker (``fuseserve.scheduler.engine_core.WorkerHandle``); None for
        a scheduler used without transport.
    num_steps: plans sent so far; the next plan's ``step_id`` (a worker runs plans in step order).
    step_time: measured seconds per pass against tokens per pass (placement).
    latency: predicted seconds of a pass of a given shape, corrected from measured passes (used with
        latency targets, ``fuseserve.scheduler.slo_budget``).
    """

    name: str
    account: BlockAccount
    token_budget: int
    max_model_len: int
    handle: Any = None
    running: list[Sequence] = field(default_factory=list)  # admission order
    pending_free: list[int] = field(default_factory=list)
    inflight: collections.deque[InFlight] = field(default_factory=collections.deque)
    num_admitted: int = 0  # sequences admitted onto this worker so far (recomputes included)
    num_steps: int = 0
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    latency: PassLatency = field(default_factory=PassLatency)
    poisoned_through: int = -1  # plans up to this step id were built on a plan that failed
    draining: bool = False  # the worker is stopping: its running sequences finish, no new ones come


class Scheduler:
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
        self.num_preemptions = 0
        self.num_forced_preemptions = 0  # of those, past max_preemptions to break a deadlock
        self.num_surplus_tokens = 0  # tokens sampled past a stop learned one pass late, dropped
        self.num_prefix_queries = 0  # tokens looked up in a prefix cache at admission
        self.num_prefix_hits = 0  # of those, tokens found cached (not computed again)
        self.model_id = ""  # part of every block hash (``fuseserve/block_hash.py``)
        self.touched: set[str] = set()  # workers given work outside their own planning (to dispatch)

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
                self.num_forced_preemptions += 1
                self.preempt(slot, victim, draft)
                draft.blocked = False
                schedule_decodes(self, slot, draft)
            if not draft.entries and not slot.pending_free:
                continue
            passes = multi_pass.plan_passes(self, slot, draft)  # None: one pass (decode_passes = 1)
            chunks = [self._chunk(seq, n) for seq, n in draft.entries]
            plan = StepPlan(slot.num_steps, chunks, slot.pending_free)
            if passes is not None:
                multi_pass.advance(draft, passes)
                plan.num_passes = max(passes.values())
            slot.num_steps += 1
            slot.pending_free = []
            hashed = [b for seq, _ in draft.entries for b in self._commit_planned(slot, seq)]
            slot.inflight.append(
                InFlight(plan, [(seq, n, seq.admitted_at) for seq, n in draft.entries], hashed, passes)
            )
            plans[slot.name] = plan
            for observe in self.pass_observers:
                observe(slot.name, draft.token_budget, plan.num_tokens)
        return plans

    def new_draft(self, slot: WorkerSlot) -> Draft:
        """An empty pass for ``slot``: the fixed budget, or with latency targets and a policy sized by
        them, the budget ``SLOBudget.pass_budget`` chooses."""
        if self.slo is not None and self.policy.sized_by_slo:
            return Draft(self.slo.pass_budget(self, slot), self.config.max_num_seqs)
        return Draft(slot.token_budget, self.config.max_num_seqs)

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        """The chunk of ``n`` tokens of ``seq`` that comes next; advances its planned counters."""
        start = seq.num_computed_tokens
        end = start + n
        # the worker feeds the token it sampled last: one sampled by a plan in flight, or one sampled
        # since admission (a recompute cut one token short of its end looks like a decode, but its
        # last token was sampled before the worker restarted it)
        decode = seq.num_pending > 0 or (not seq.in_prefill and seq.num_tokens > seq.num_tokens_at_admission)
        sample = end == seq.num_planned_tokens
        first = start == seq.num_start_tokens  # the first chunk since admission (after its cached prefix)
        chunk = SeqChunk(
            seq_id=seq.seq_id,
            start_pos=start,
            num_tokens=n,
            token_ids=[] if decode else seq.token_slice(start, end),
            sample=sample,
            params=seq.params if first else None,
            prompt_len=seq.prompt_len if first else 0,
            block_ids=self.slots[seq.worker].account.unsent(seq.seq_id),
            prefix_token_ids=seq.token_slice(0, start) if first else [],
        )
        seq.num_computed_tokens = end
        if sample:
            seq.num_pending += 1
        return chunk

    def _commit_planned(self, slot: WorkerSlot, seq: Sequence) -> list[int]:
        """Hash the blocks of ``seq`` that its plans sent so far fill (tokens known); returns their ids."""
        end = min(seq.num_computed_tokens, seq.num_tokens)  # a decode input sampled in flight is unknown
        if not slot.account.needs_commit(seq.seq_id, end):
            return []
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
        self.num_preemptions += 1
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

    def can_admit(self, slot: WorkerSlot, seq: Sequence, extra_blocks: int = 0) -> bool:
        """Rule 2: blocks for the whole remaining prompt (past its cached prefix) plus the watermark
        (plus ``extra_blocks``), and a free sequence slot, on a worker that is not draining."""
        return (
            not slot.draining
            and len(slot.running) < self.config.max_num_seqs
            and slot.account.can_reserve(
                seq.seq_id,
                seq.num_tokens,
                self.config.watermark_blocks + extra_blocks,
                self.prefix_hit(slot, seq),
            )
        )

    def prefix_hit(self, slot: WorkerSlot, seq: Sequence) -> list[int]:
        """Ids of ``slot``'s cached blocks holding the longest prefix of ``seq``'s tokens.

        At most ``num_tokens - 1`` tokens are taken from the cache: the last one must run to sample.
        Empty (no hit) with ``prompt_logprobs``: a cached position is not computed, so it would
        have no logprobs (vLLM skips the cache for these requests too).
        """
        if not self.config.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs = slot.account.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return []
        return slot.account.match(
            seq.full_block_hashes(bs, root_hash(self.model_id, seq.cache_salt)), max_blocks
        )

    def admit(self, slot: WorkerSlot, seq: Sequence) -> None:
        """Move ``seq`` from the queue onto ``slot``, reserving blocks for all its known tokens; the
        tokens of its cached prefix count as computed, so its first chunk starts after them."""
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        shared = self.prefix_hit(slot, seq)
        slot.account.reserve(seq.seq_id, seq.num_tokens, shared)
        seq.num_start_tokens = seq.num_computed_tokens = len(shared) * slot.account.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_start_tokens
        if self.config.enable_prefix_caching and seq.params.prompt_logprobs is None:  # looked up
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_start_tokens
        seq.status = SeqStatus.RUNNING
        seq.worker = slot.name
        seq.admitted_at = next(self._admit_counter)
        seq.num_tokens_at_admission = seq.num_tokens
        slot.running.append(seq)
        slot.num_admitted += 1
        self.touched.add(slot.name)

    def place(
        self, seq: Sequence, here: list[WorkerSlot], elsewhere: bool, planning: list[WorkerSlot]
    ) -> WorkerSlot | None:
        """The worker that would serve ``seq`` soonest, or None when none can take it now.

        ``here``: workers being planned whose pass has room for the prompt. ``elsewhere``: workers
        not being planned (``planning``) are candidates too, while their queued prompt tokens are
        under one pass (a prompt is bound to a worker at most a pass ahead) and they keep a block per
        running sequence for its next decode. Every candidate must pass rule 2. Soonest: the smallest
        ``placement.seconds_per_share`` (sequences in proportion to measured speed); ties (no
        measurement yet) go to the worker with the larger share of free blocks, then fewer running
        sequences. With prefix-aware placement, the workers loaded near the least
        (``placement.near_least_loaded``) are candidates first and the one caching the most of the
        prompt wins.
        """
        candidates = [s for s in here if self.can_admit(s, seq)]
        if elsewhere:
            for slot in self.slots.values():
                if (
                    slot not in planning
                    and self._queued_prompt_tokens(slot) < slot.token_budget
                    and self.can_admit(slot, seq, extra_blocks=len(slot.running))
                ):
                    candidates.append(slot)
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        measured = [s.step_time for s in self.slots.values() if s.step_time.seconds(1) is not None]
        fallback = measured[0] if measured else None
        shares = [
            seconds_per_share(s.step_time, fallback, s.token_budget, len(s.running)) for s in candidates
        ]

        def key(i: int):
            s = candidates[i]
            return (round(shares[i], 9), -s.account.num_free / s.account.num_blocks, len(s.running))

        order = range(len(candidates))
        if self.config.enable_prefix_caching and self.config.prefix_aware_placement:
            hits = [len(self.prefix_hit(s, seq)) for s in candidates]
            if any(hits):  # follow the prefix among the workers loaded near the least
                near = near_least_loaded(shares, [len(s.running) for s in candidates])
                return candidates[min((i for i in order if near[i]), key=lambda i: (-hits[i], key(i)))]
        return candidates[min(order, key=key)]

    @staticmethod
    def _queued_prompt_tokens(slot: WorkerSlot) -> int:
        """Prompt tokens placed on ``slot`` that no plan has taken yet."""
        return sum(seq.num_uncomputed for seq in slot.running if seq.in_prefill)

    def least_loaded(self, candidates: list[WorkerSlot]) -> WorkerSlot:
        """The worker with the most free blocks (in proportion), then the fewest running sequences."""
        return max(candidates, key=lambda s: (s.account.num_free / s.account.num_blocks, -len(s.running)))

    def fail_plan(self, worker: str, message: str) -> list[TokenEvent]:
        """The oldest plan in flight on ``worker`` failed (not a lost worker): finish its sequences.

        Their blocks are released here and freed on the worker with its next plan, so a bad request
        cannot wedge the worker or the engine. Plans already sent after it were built on its
        outcome: their sequences recompute instead of failing (``poisoned_through``).
        """
        slot = self.slots.get(worker)
        if slot is None or not slot.inflight:
            return []
        record = slot.inflight.popleft()
        poisoned = record.plan.step_id <= slot.poisoned_through
        if slot.inflight:
            slot.poisoned_through = slot.inflight[-1].plan.step_id
        events = []
        for seq, _, admitted_at in record.entries:
            if not self._live(seq, worker, admitted_at):
                continue
            if poisoned:
                self._to_waiting(seq)
            else:
                self._finish(seq, FinishReason.ABORT)
                events.append(TokenEvent(seq.seq_id, None, FinishReason.ABORT, error=message))
        # the blocks this plan and the later ones were to fill may hold garbage: no longer cached, and
        # a sequence that shares one recomputes
        bad = set(record.hashed).union(*(r.hashed for r in slot.inflight))
        slot.account.uncommit(sorted(bad))
        for seq in [s for s in slot.running if bad.intersection(slot.account.tables.get(s.seq_id, ()))]:
            self._to_waiting(seq)
        return events

    def fail_waiting(self, message: str, status: int) -> list[TokenEvent]:
        """Finish every queued sequence with an error (e.g. no worker has been alive for a while)."""
        events = []
        while self.waiting:
            seq = self.waiting.popleft()
            self._finish(seq, FinishReason.ABORT)
            events.append(
                TokenEvent(seq.seq_id, None, FinishReason.ABORT, error=message, error_status=status)
            )
        return events

    # ----- postprocess -----
    @staticmethod
    def _live(seq: Sequence, worker: str, admitted_at: int) -> bool:
        return seq.status is SeqStatus.RUNNING and seq.worker == worker and seq.admitted_at == admitted_at

    def postprocess(self, worker: str, result: StepResult) -> list[TokenEvent]:
        """Apply the oldest plan in flight on ``worker``: new tokens, EOS / stop ids / length stops.

        Tokens of sequences finished, preempted or moved since the plan was sent are dropped.
        Raises ``SchedulerError`` when ``result`` does not answer that plan.
        """
        slot = self.slots.get(worker)
        if slot is None or not slot.inflight:
            return []
        record = slot.inflight.popleft()
        if result.step_id != record.plan.step_id:
            raise SchedulerError(
                f"worker {worker}: result of step {result.step_id}, expected {record.plan.step_id}"
            )
        if record.passes is not None:  # per pass: placement and the latency fit see one pass
            seconds = result.forward_seconds / max(1, result.num_passes)
            slot.step_time.observe(record.plan.num_tokens, seconds)
            if self.slo is not None:
                slot.latency.observe(PassShape.of_plan(record.plan), seconds)
            return multi_pass.apply_passes(self, worker, record, result)
        slot.step_time.observe(record.plan.num_tokens, result.forward_seconds)
        if self.slo is not None:
            slot.latency.observe(PassShape.of_plan(record.plan), result.forward_seconds)
        sampled = {t.seq_id: t for t in result.tokens}
        scored = {p.seq_id: p for p in result.prompt_logprobs}
        events = []
        for seq, _, admitted_at in record.entries:
            if seq.seq_id in scored and self._live(seq, worker, admitted_at):  # before its first token
                events.append(TokenEvent(seq.seq_id, None, prompt_logprobs=scored[seq.seq_id]))
            tok = sampled.get(seq.seq_id)
            if tok is None:
                continue
            if not self._live(seq, worker, admitted_at):
                if seq.status is SeqStatus.FINISHED:
                    self.num_surplus_tokens += 1
                continue
            seq.num_pending -= 1
            seq.output_token_ids.append(tok.token_id)
            reason, hidden = self._stop_reason(seq, tok.token_id)
            index = len(seq.output_token_ids) - 1
            cached = (seq.num_cached_tokens or 0) if index == 0 else 0
            events.append(TokenEvent(seq.seq_id, tok, reason, hidden, index=index, cached_tokens=cached))
            if reason is not None:
                self._finish(seq, reason)
        return events

    def _stop_reason(self, seq: Sequence, token_id: int) -> tuple[FinishReason | None, bool]:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_new_tokens:
            if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
                return FinishReason.STOP, True
        if n_out >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, False
        return None, False

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._detach(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
