"""Postprocess: the results of plans applied to their sequences (tokens, stops), and failed plans.

A result applies to the oldest plan in flight on its worker; tokens of sequences finished, preempted
or moved since the plan was sent are dropped (a stop learned one pass late leaves one surplus token,
``fuseserve.scheduler.scheduler``). A multi-pass result (``fuseserve.scheduler.multi_pass_plan``) holds
each sequence's tokens in pass order; tokens after a stop are surplus. Every token goes through the
one stop rule, ``fuseserve.stop_rule.check_stop``.
"""

from __future__ import annotations

import collections
import logging

from fuseserve.errors import SchedulerError
from fuseserve.pass_shape import PassShape
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.seq_lifecycle import SeqLifecycle
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import InFlight, WorkerSlot
from fuseserve.stop_rule import check_stop
from fuseserve.types import SampledToken, StepResult, TokenEvent

log = logging.getLogger(__name__)


class ResultApplier:
    """Applies results and failures of the plans in flight on the workers of ``registry``.

    eos_token_ids: the model's EOS ids (set again when a worker's record names them).
    observe_latency: feed each pass's shape and seconds to the worker's latency model (with
    latency targets, ``fuseserve.scheduler.slo_budget``). Surplus tokens are counted in ``counters``.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        lifecycle: SeqLifecycle,
        counters: SchedulerCounters,
        eos_token_ids: set[int],
        observe_latency: bool,
    ):
        self.registry = registry
        self.lifecycle = lifecycle
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.observe_latency = observe_latency

    def postprocess(self, worker: str, result: StepResult) -> list[TokenEvent]:
        """Apply the oldest plan in flight on ``worker``: new tokens, EOS / stop ids / length stops.

        Tokens of sequences finished, preempted or moved since the plan was sent are dropped.
        Raises ``SchedulerError`` when ``result`` does not answer that plan.
        """
        slot = self.registry.slots.get(worker)
        if slot is None or not slot.inflight:
            return []
        record = slot.inflight.popleft()
        if result.step_id != record.plan.step_id:
            raise SchedulerError(
                f"worker {worker}: result of step {result.step_id}, expected {record.plan.step_id}"
            )
        seconds = result.forward_seconds
        if record.passes is not None:  # per pass: placement and the latency fit see one pass
            seconds /= max(1, result.num_passes)
        slot.step_time.observe(record.num_tokens, seconds)
        if self.observe_latency:
            slot.latency.observe(PassShape.of_plan(record.plan), seconds)
        if record.passes is not None:
            return self._apply_passes(worker, record, result)
        sampled = {t.seq_id: t for t in result.tokens}
        scored = {p.seq_id: p for p in result.prompt_logprobs} if result.prompt_logprobs else None
        events = []
        is_live = self.lifecycle.is_live
        for seq, _, admitted_at in record.entries:
            live = is_live(seq, worker, admitted_at)
            if scored and seq.seq_id in scored and live:  # before its first token
                events.append(TokenEvent(seq.seq_id, None, prompt_logprobs=scored[seq.seq_id]))
            tok = sampled.get(seq.seq_id)
            if tok is None:
                continue
            if not live:
                if seq.status is SeqStatus.FINISHED:
                    self.counters.num_surplus_tokens += 1
                continue
            events.append(self._take(seq, tok))
        return events

    def _take(self, seq: Sequence, tok: SampledToken) -> TokenEvent:
        """Append ``tok`` to live ``seq``, apply the stop rule (finishing it on a stop); its event."""
        seq.num_pending -= 1
        out = seq.output_token_ids
        out.append(tok.token_id)
        n_out = len(out)
        reason = check_stop(
            seq.params,
            tok.token_id,
            n_out,
            len(seq.prompt_token_ids) + n_out,
            self.eos_token_ids,
            self.registry.max_model_len,
        )
        index = n_out - 1
        cached = (seq.num_cached_tokens or 0) if index == 0 else 0
        hidden = reason is FinishReason.STOP  # a stop token is not part of the text
        if reason is not None:
            self.lifecycle.finish(seq, reason)
        return TokenEvent(seq.seq_id, tok, reason, hidden, index=index, cached_tokens=cached)

    def _apply_passes(self, worker: str, record: InFlight, result: StepResult) -> list[TokenEvent]:
        """Apply a multi-pass result: each sequence's tokens in pass order, with the token-level stops.

        Tokens after a stop, and tokens of sequences finished since the plan was sent, are surplus. A
        live sequence that got fewer tokens than planned without a stop (the worker stopped it by a
        rule the scheduler does not share) recomputes: its counters expect every planned token.
        """
        by_seq: dict[int, list[SampledToken]] = collections.defaultdict(list)
        for t in result.tokens:
            by_seq[t.seq_id].append(t)
        events = []
        for seq, _, admitted_at in record.entries:
            toks = by_seq.get(seq.seq_id, ())
            if not self.lifecycle.is_live(seq, worker, admitted_at):
                if seq.status is SeqStatus.FINISHED:
                    self.counters.num_surplus_tokens += len(toks)
                continue
            for i, tok in enumerate(toks):
                event = self._take(seq, tok)
                events.append(event)
                if event.finish_reason is not None:
                    self.counters.num_surplus_tokens += len(toks) - i - 1
                    break
            else:
                if len(toks) < record.passes[seq.seq_id]:
                    log.warning(
                        "seq %d: %d of %d planned tokens came back without a stop; recomputing",
                        seq.seq_id,
                        len(toks),
                        record.passes[seq.seq_id],
                    )
                    self.lifecycle.to_waiting(seq)
        return events

    def fail_plan(self, worker: str, message: str) -> list[TokenEvent]:
        """The oldest plan in flight on ``worker`` failed (not a lost worker): finish its sequences.

        Their blocks are released here and freed on the worker with its next plan, so a bad request
        cannot wedge the worker or the engine. Plans already sent after it were built on its
        outcome: their sequences recompute instead of failing (``poisoned_through``).
        """
        slot = self.registry.slots.get(worker)
        if slot is None or not slot.inflight:
            return []
        record = slot.inflight.popleft()
        poisoned = record.plan.step_id <= slot.poisoned_through
        if slot.inflight:
            slot.poisoned_through = slot.inflight[-1].plan.step_id
        events = []
        for seq, _, admitted_at in record.entries:
            if not self.lifecycle.is_live(seq, worker, admitted_at):
                continue
            if poisoned:
                self.lifecycle.to_waiting(seq)
            else:
                self.lifecycle.finish(seq, FinishReason.ABORT)
                events.append(TokenEvent(seq.seq_id, None, FinishReason.ABORT, error=message))
        self._uncache(slot, record)
        return events

    def _uncache(self, slot: WorkerSlot, record: InFlight) -> None:
        """The blocks a failed plan and the later ones were to fill may hold garbage: no longer
        cached, and a sequence that shares one recomputes."""
        bad = set(record.hashed).union(*(r.hashed for r in slot.inflight))
        slot.account.uncommit(sorted(bad))
        for seq in [s for s in slot.running if bad.intersection(slot.account.tables.get(s.seq_id, ()))]:
            self.lifecycle.to_waiting(seq)
