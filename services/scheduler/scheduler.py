"""The central scheduler: builds one step plan per worker within the token budget (paper §3).

Lifecycle: ``add`` → ``schedule`` (plans) → workers run them → ``postprocess`` (tokens, stops) →
``schedule`` ... Works in counts and ids only (STYLE 2): token counts per sequence, free-block
counts per worker. The SplitFuse rules (DESIGN "SplitFuse scheduling rules"):

1. decode tokens first (one per running sequence), then continuing prompt chunks, then new prompts,
   filling the budget exactly; the last prompt taken is cut to fit;
2. a prompt is admitted only when blocks exist for its whole remaining prompt plus a watermark;
3. a running sequence that cannot get a block preempts the most recently admitted sequence
   (recompute later from prompt + generated tokens); at most ``max_preemptions`` per sequence.

``prefill_first`` (vLLM v0, TGI before chunking) and ``whole_prompt`` (Orca) are the same machinery
with different choices (``fuseserve.scheduler.policies``).
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass, field

from fuseserve.config import EngineConfig
from fuseserve.errors import ContextLengthExceededError, InvalidRequestError, SchedulerError
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.policies import Policy, get_policy, schedule_decodes
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.types import SampledToken, SeqChunk, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """A token produced for a sequence; ``finish_reason`` set on its last event.

    hidden: the token ended the sequence as EOS / a stop token id and is not part of the text.
    error: why the sequence failed (with ``finish_reason`` ABORT), e.g. the worker rejected its step;
    error_status: the HTTP status that error maps to (500 engine failure, 503 no worker).
    """

    seq_id: int
    token: SampledToken | None
    finish_reason: FinishReason | None = None
    hidden: bool = False
    error: str | None = None
    error_status: int = 500


@dataclass
class WorkerSlot:
    """The scheduler's view of one worker: capacity, running sequences, the plan in flight."""

    name: str
    account: BlockAccount
    token_budget: int
    max_model_len: int
    running: list[Sequence] = field(default_factory=list)  # admission order
    pending_free: list[int] = field(default_factory=list)
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # the plan being built / in flight
    num_admitted: int = 0  # sequences admitted onto this worker so far (recomputes included)

    @property
    def budget_left(self) -> int:
        return self.token_budget - sum(n for _, n in self.entries)


class Scheduler:
    """Plans passes for every worker and applies token-level stops.

    Args:
        config: token_budget (None → each worker's own, chosen by profiling), max_num_seqs,
            watermark_blocks, max_preemptions, policy.
        eos_token_ids: the model's EOS ids (generation config).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: list[int]):
        config.validate()
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.policy: Policy = get_policy(config.policy)
        self.slots: dict[str, WorkerSlot] = {}
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.seqs: dict[int, Sequence] = {}
        self._admit_counter = itertools.count()
        self._step_counter = itertools.count()
        self.num_preemptions = 0
        self.num_forced_preemptions = 0  # of those, past max_preemptions to break a deadlock

    # ----- workers -----
    def add_worker(
        self, name: str, num_blocks: int, block_size: int, max_model_len: int, token_budget: int | None = None
    ) -> None:
        """Register a worker's capacity. ``token_budget`` is the worker's profiled budget."""
        budget = self.config.token_budget or token_budget
        if budget is None:
            raise SchedulerError(f"worker {name}: no token budget configured or profiled")
        self.slots[name] = WorkerSlot(name, BlockAccount(num_blocks, block_size), budget, max_model_len)

    def remove_worker(self, name: str) -> list[Sequence]:
        """Forget a lost worker; its sequences go back to the front of the queue for recompute."""
        slot = self.slots.pop(name, None)
        if slot is None:
            return []
        moved = list(slot.running)
        for seq in reversed(moved):
            self._to_waiting(seq)
        return moved

    # ----- requests -----
    @property
    def max_model_len(self) -> int:
        return min((s.max_model_len for s in self.slots.values()), default=1 << 30)

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
        return bool(self.waiting) or any(s.running or s.pending_free for s in self.slots.values())

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.slots.values())

    # ----- schedule -----
    def schedule(self) -> dict[str, StepPlan]:
        """Build the next plan of every worker that has something to do."""
        for slot in self.slots.values():
            slot.entries = []
        self.policy.schedule(self)
        for slot in self.slots.values():
            while slot.running and not slot.entries:
                # every running sequence waits for a block and none may be preempted under the cap:
                # nothing would ever run again, so preempt the newest past its cap (liveness first)
                victim = max(slot.running, key=lambda s: s.admitted_at)
                log.warning("seq %d preempted past the cap to break a KV-cache deadlock", victim.seq_id)
                self.num_forced_preemptions += 1
                self.preempt(slot, victim)
                schedule_decodes(self, slot)
        plans = {}
        for slot in self.slots.values():
            if not slot.entries and not slot.pending_free:
                continue
            chunks = [self._chunk(seq, n) for seq, n in slot.entries]
            plans[slot.name] = StepPlan(next(self._step_counter), chunks, slot.pending_free)
            slot.pending_free = []
        return plans

    def _chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed_tokens
        end = start + n
        # the worker feeds the token it sampled last; a recompute cut one token short of its end
        # looks like a decode but its last token was sampled before the worker restarted it
        decode = not seq.in_prefill and seq.num_tokens > seq.num_tokens_at_admission
        return SeqChunk(
            seq_id=seq.seq_id,
            start_pos=start,
            num_tokens=n,
            token_ids=[] if decode else seq.token_slice(start, end),
            sample=end == seq.num_tokens,
            params=seq.params if start == 0 else None,
            prompt_len=seq.prompt_len if start == 0 else 0,
        )

    # primitives the policies use
    def reserve_or_preempt(self, slot: WorkerSlot, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for ``seq`` to hold ``num_tokens``; preempt newer sequences if needed (rule 3).

        Returns False when ``seq`` cannot run this step (it was preempted itself, or no victim exists).
        """
        while not slot.account.can_reserve(seq.seq_id, num_tokens):
            victim = self._victim(slot, seq)
            if victim is None:
                return False
            self.preempt(slot, victim)
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

    def preempt(self, slot: WorkerSlot, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes later from prompt + generated tokens."""
        slot.entries = [(s, n) for s, n in slot.entries if s is not seq]
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
        seq.worker = None

    def _to_waiting(self, seq: Sequence) -> None:
        self._detach(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def can_admit(self, slot: WorkerSlot, seq: Sequence) -> bool:
        """Rule 2: blocks for the whole remaining prompt plus the watermark, and a free sequence slot."""
        return len(slot.running) < self.config.max_num_seqs and slot.account.can_reserve(
            seq.seq_id, seq.num_tokens, self.config.watermark_blocks
        )

    def admit(self, slot: WorkerSlot, seq: Sequence) -> None:
        """Move the head of the queue onto ``slot``, reserving blocks for all its known tokens."""
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        slot.account.reserve(seq.seq_id, seq.num_tokens)
        seq.status = SeqStatus.RUNNING
        seq.worker = slot.name
        seq.admitted_at = next(self._admit_counter)
        seq.num_tokens_at_admission = seq.num_tokens
        slot.running.append(seq)
        slot.num_admitted += 1

    def least_loaded(self, candidates: list[WorkerSlot]) -> WorkerSlot:
        """Placement: the worker with the most free blocks, then the fewest running sequences."""
        return max(candidates, key=lambda s: (s.account.num_free / s.account.num_blocks, -len(s.running)))

    def fail_plan(self, worker: str, message: str) -> list[TokenEvent]:
        """The plan in flight on ``worker`` failed (not a lost worker): finish its sequences with an error.

        Their blocks are released here and freed on the worker with its next plan, so a bad request
        cannot wedge the worker or the engine.
        """
        slot = self.slots.get(worker)
        if slot is None:
            return []
        events = []
        for seq, _ in slot.entries:
            if seq.status is SeqStatus.RUNNING and seq.worker == worker:
                self._finish(seq, FinishReason.ABORT)
                events.append(TokenEvent(seq.seq_id, None, FinishReason.ABORT, error=message))
        slot.entries = []
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
    def postprocess(self, worker: str, result: StepResult) -> list[TokenEvent]:
        """Advance counters of the plan that ran on ``worker``; apply EOS / stop ids / length stops."""
        slot = self.slots.get(worker)
        if slot is None:
            return []
        sampled = {t.seq_id: t for t in result.tokens}
        events = []
        for seq, n in slot.entries:
            if seq.status is not SeqStatus.RUNNING or seq.worker != worker:
                continue  # aborted or moved while the step ran
            seq.num_computed_tokens += n
            tok = sampled.get(seq.seq_id)
            if tok is None:
                continue
            seq.output_token_ids.append(tok.token_id)
            reason, hidden = self._stop_reason(seq, tok.token_id)
            events.append(TokenEvent(seq.seq_id, tok, reason, hidden))
            if reason is not None:
                self._finish(seq, reason)
        slot.entries = []
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
