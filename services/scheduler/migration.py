"""KV migration, the scheduler's side: a draining worker's decoding sequences move to other workers
with their K/V (``services/worker/kv_migration.py``) instead of finishing there or recomputing.

With ``migration="drain"`` a worker that starts draining is not planned again; once no plan of it is
in flight, one round of moves is planned (``Migrations.start``): each sequence goes to the worker with
the largest share of free blocks that can hold its computed tokens plus a block and the watermark
(blocks reserved there now, in table order), decoding or part-way through its prompt (the rest of
the prompt is computed there); one that has computed nothing here yet goes back to the queue; one
that fits nowhere, or asked for prompt logprobs, stays and finishes at home. The
engine core sends each destination's moves to the source worker's handle (``migrate``); when the
answer comes (``Migrations.done``), each moved sequence is re-pointed to its destination (its next
decode entry goes there, no token recomputed), and the blocks of one not moved are given back. After
the round the source worker is planned again for whatever stayed (it finishes there, as before).

Not migrated: sequences that asked for prompt logprobs, workers whose handle cannot ``migrate``
(in-process runners, tensor parallel), a lost worker (its blocks are gone: recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fuseserve.config import EngineConfig
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.seq_lifecycle import SeqLifecycle
from fuseserve.scheduler.sequence import SeqStatus, Sequence
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import MigrationPhase, WorkerSlot


@dataclass
class MigrationOrder:
    """The moves from one source worker to one destination: ``moves`` are ``(sequence, destination
    block ids)`` in order."""

    source: str
    dest: str
    moves: list[tuple[Sequence, list[int]]] = field(default_factory=list)


@dataclass
class MigrationResult:
    """A source worker's answer to an order: the sequences now on the destination, the K/V bytes sent,
    the transfer's wall seconds, and why the others were not moved (empty: all were)."""

    moved: list[int]
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


class Migrations:
    """The migration rounds of draining workers (``config.migration``), over the scheduler's
    ``registry`` and ``lifecycle``; counts into ``counters``."""

    def __init__(
        self,
        config: EngineConfig,
        registry: WorkerRegistry,
        lifecycle: SeqLifecycle,
        counters: SchedulerCounters,
    ):
        self.config = config
        self.registry = registry
        self.lifecycle = lifecycle
        self.counters = counters
        self.pending: dict[str, int] = {}  # source worker -> orders not answered yet

    def wanted(self, slot: WorkerSlot) -> bool:
        """``slot`` drains, migration is on, its handle migrates and its round is not over: it gets
        no plan (its round starts once nothing of it is in flight)."""
        return (
            slot.draining
            and self.config.migration == "drain"
            and slot.migration is not MigrationPhase.DONE
            and hasattr(slot.handle, "migrate")
            and (slot.migration is MigrationPhase.MOVING or bool(slot.running))
        )

    def start(self, name: str) -> list[MigrationOrder]:
        """Plan ``name``'s round of moves (no plan of it in flight); returns one order per destination
        (none: the round is over at once)."""
        slot = self.registry.slots[name]
        orders: dict[str, MigrationOrder] = {}
        adapters: dict[str, set[str]] = {}  # destination -> LoRA adapters moved there this round
        for seq in list(slot.running):
            if seq.params.prompt_logprobs is not None:
                continue  # its scorer's state does not move: it finishes here
            dest = self._destination(slot, seq, adapters)
            if dest is None:
                continue  # no room anywhere (or no other worker): it finishes here
            if seq.num_computed_tokens <= seq.num_start_tokens:
                self.lifecycle.to_waiting(seq)  # nothing computed here yet: it starts elsewhere
                continue
            if seq.lora is not None:
                adapters.setdefault(dest.name, set()).add(seq.lora)
            dest.account.reserve(seq.seq_id, seq.num_computed_tokens)
            order = orders.setdefault(dest.name, MigrationOrder(name, dest.name))
            order.moves.append((seq, dest.account.unsent(seq.seq_id)))
        slot.migration = MigrationPhase.MOVING if orders else MigrationPhase.DONE
        self.pending[name] = len(orders)
        self.registry.touched.add(name)
        return list(orders.values())

    def _destination(
        self, source: WorkerSlot, seq: Sequence, adapters: dict[str, set[str]]
    ) -> WorkerSlot | None:
        need = seq.num_computed_tokens + 1  # its K/V and the block of its next decode
        fits = [
            s
            for s in self.registry.slots.values()
            if s is not source
            and not s.draining
            and s.account.can_reserve(seq.seq_id, need, self.config.watermark_blocks)
            and len(s.running) < self.config.max_num_seqs
            and self._lora_fits(s, seq, adapters.get(s.name, set()))
        ]
        return max(fits, key=lambda s: s.account.num_free / s.account.num_blocks, default=None)

    def _lora_fits(self, slot: WorkerSlot, seq: Sequence, moving: set[str]) -> bool:
        """``seq``'s adapter may join ``slot`` with those moving there this round: the worker serves it,
        and at most ``max_loras`` distinct adapters run on a worker (``WaitingQueue.lora_fits``' rule)."""
        if seq.lora is None:
            return True
        if not slot.serves_lora(seq.lora):
            return False
        held = {s.lora for s in slot.running if s.lora is not None} | moving
        return seq.lora in held or len(held) < self.config.max_loras

    def done(self, order: MigrationOrder, result: MigrationResult | Exception) -> None:
        """Apply a source worker's answer: re-point each moved sequence to its destination; give the
        destination blocks of the others back (they stay on the source, or, when the source is gone,
        they were put back in the queue already)."""
        moved = set() if isinstance(result, Exception) else set(result.moved)
        src, dst = self.registry.slots.get(order.source), self.registry.slots.get(order.dest)
        for seq, _ in order.moves:
            here = src is not None and seq.status is SeqStatus.RUNNING and seq.worker == order.source
            if seq.seq_id in moved and here and dst is not None:
                src.account.release(seq.seq_id)  # the source worker dropped its copy itself
                src.running.remove(seq)
                dst.running.append(seq)
                seq.worker = dst.name
                dst.num_admitted += 1
                self.counters.num_migrated += 1
            elif dst is not None:  # not moved, or finished / aborted meanwhile: drop the reservation
                dst.account.release(seq.seq_id)
                if seq.seq_id in moved or isinstance(result, Exception):
                    dst.pending_free.append(seq.seq_id)  # the destination may hold it: free it there
            if dst is not None:
                self.registry.touched.add(dst.name)
        if not isinstance(result, Exception):
            self.counters.num_migrated_bytes += result.num_bytes
            self.counters.migration_seconds += result.seconds
        left = self.pending.get(order.source, 1) - 1
        self.pending[order.source] = left
        if left <= 0 and src is not None:
            src.migration = MigrationPhase.DONE
            self.registry.touched.add(src.name)
