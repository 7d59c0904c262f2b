"""The live sequences by id and their moves: waiting → running (``WaitingQueue.admit``) → finished,
or back to waiting (preempted, their worker lost, their plan poisoned). A sequence taken off its
worker releases its blocks there at once; the worker frees them with its next plan."""

from __future__ import annotations

import collections

from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.worker_registry import WorkerRegistry


class SeqLifecycle:
    """Owns ``seqs`` (every sequence not finished, by id); moves sequences between the ``waiting``
    queue (the ``WaitingQueue``'s deque), the workers of ``registry`` and the end; counts recomputes
    into ``counters``."""

    def __init__(
        self,
        registry: WorkerRegistry,
        waiting: collections.deque[Sequence],
        counters: SchedulerCounters | None = None,
    ):
        self.registry = registry
        self.counters = counters or SchedulerCounters()
        self.waiting = waiting
        self.seqs: dict[int, Sequence] = {}

    @staticmethod
    def is_live(seq: Sequence, worker: str, admitted_at: int) -> bool:
        """A plan's entry still applies: ``seq`` runs on ``worker`` under the same admission."""
        return seq.status is SeqStatus.RUNNING and seq.worker == worker and seq.admitted_at == admitted_at

    def detach(self, seq: Sequence) -> None:
        """Take ``seq`` off its worker: release its blocks now, free them on the worker with the next plan."""
        slot = self.registry.slots.get(seq.worker) if seq.worker else None
        if slot is not None:
            slot.account.release(seq.seq_id)
            if seq in slot.running:
                slot.running.remove(seq)
            slot.pending_free.append(seq.seq_id)
            self.registry.touched.add(slot.name)
        seq.worker = None
        seq.num_pending = 0  # tokens of plans in flight are dropped when they arrive

    def to_waiting(self, seq: Sequence) -> None:
        """Back to the front of the queue, to recompute from its prompt and generated tokens."""
        self.detach(seq)
        seq.status = SeqStatus.WAITING
        self.counters.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (its blocks are released, its id forgotten)."""
        self.detach(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
