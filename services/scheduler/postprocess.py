"""Postprocess: results of plans applied to their sequences (tokens, stops), and failed plans.

Part of ``Scheduler`` (a base class of it). A result applies to the oldest plan in flight on its
worker; tokens of sequences finished, preempted or moved since the plan was sent are dropped (a stop
learned one pass late leaves one surplus token, ``fuseserve.scheduler.scheduler``).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from fuseserve.errors import SchedulerError
from fuseserve.pass_shape import PassShape
from fuseserve.scheduler import multi_pass
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.worker_slot import WorkerSlot
from fuseserve.stop_rule import check_stop
from fuseserve.types import StepResult, TokenEvent

if TYPE_CHECKING:
    from fuseserve.scheduler.core_stats import SchedulerCounters
    from fuseserve.scheduler.slo_budget import SLOBudget


class Postprocess:
    """The postprocess half of ``fuseserve.scheduler.scheduler.Scheduler``, over the scheduler's
    state: ``slots``, ``waiting``, ``eos_token_ids``, ``slo`` and its ``_finish`` / ``_to_waiting``."""

    slots: dict[str, WorkerSlot]
    waiting: collections.deque[Sequence]
    eos_token_ids: set[int]
    slo: SLOBudget | None
    counters: SchedulerCounters
    _max_model_len: int

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
            slot.step_time.observe(record.num_tokens, seconds)
            if self.slo is not None:
                slot.latency.observe(PassShape.of_plan(record.plan), seconds)
            return multi_pass.apply_passes(self, worker, record, result)
        slot.step_time.observe(record.num_tokens, result.forward_seconds)
        if self.slo is not None:
            slot.latency.observe(PassShape.of_plan(record.plan), result.forward_seconds)
        sampled = {t.seq_id: t for t in result.tokens}
        scored = {p.seq_id: p for p in result.prompt_logprobs} if result.prompt_logprobs else None
        events = []
        running = SeqStatus.RUNNING
        eos_ids = self.eos_token_ids
        max_model_len = self._max_model_len
        for seq, _, admitted_at in record.entries:
            live = seq.status is running and seq.worker == worker and seq.admitted_at == admitted_at
            if scored and seq.seq_id in scored and live:  # before its first token
                events.append(TokenEvent(seq.seq_id, None, prompt_logprobs=scored[seq.seq_id]))
            tok = sampled.get(seq.seq_id)
            if tok is None:
                continue
            if not live:
                if seq.status is SeqStatus.FINISHED:
                    self.counters.num_surplus_tokens += 1
                continue
            seq.num_pending -= 1
            out = seq.output_token_ids
            out.append(tok.token_id)
            n_out = len(out)
            reason = check_stop(
                seq.params, tok.token_id, n_out, len(seq.prompt_token_ids) + n_out, eos_ids, max_model_len
            )
            index = n_out - 1
            cached = (seq.num_cached_tokens or 0) if index == 0 else 0
            hidden = reason is FinishReason.STOP  # a stop token is not part of the text
            events.append(TokenEvent(seq.seq_id, tok, reason, hidden, index=index, cached_tokens=cached))
            if reason is not None:
                self._finish(seq, reason)
        return events
