"""KV migration, the scheduler's side: a draining worker's decoding sequences move to other workers
with their K/V (``services/worker/kv_migration.py``) instead of finishing there or recomputing.

With ``migration="drain"`` a worker that starts draining is not planned again; once no plan of it is
in flight, one round of moves is planned (``Migrations.start``): each sequence goes to the worker with
the largest share of free blocks that can hold all its tokens (its computed K/V, the rest of its
prompt or its next decode) and the watermark (blocks reserved there now, in table order: the K/V fills
the first ones; those of its computed prefix that the destination's prefix cache holds are shared
there, reference counted, and not sent), decoding or part-way through its prompt (the rest of
the prompt is computed there); one that has computed nothing here yet goes back to the queue; one
that fits nowhere, or asked for prompt logprobs, stays and finishes at home. The
engine core sends each destination's moves to the source worker's handle (``migrate``); when the
answer comes (``Migrations.done``), each moved sequence is re-pointed to its destination (its next
decode entry goes there, no token recomputed), and the blocks of one not moved are given back. After
the round the source worker is planned again for whatever stayed (it finishes there, as before).

With ``migration="balance"`` the same round also runs for a worker that is not draining, over the
moves ``rebalance.plan_rebalance`` chose (``WorkerSlot.balance``: sequence -> destination); after it
the worker is planned again as usual and may rebalance again later.

Not migrated: sequences that asked for prompt logprobs, workers whose handle cannot ``migrate``
(in-process runners, tensor parallel), a lost worker (its blocks are gone: recompute).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fuseserve.config import EngineConfig
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.rebalance import BALANCE_INTERVAL_S, balances, plan_rebalance
from fuseserve.scheduler.seq_lifecycle import SeqLifecycle
from fuseserve.scheduler.sequence import SeqStatus, Sequence
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import MigrationPhase, WorkerSlot

log = logging.getLogger(__name__)


@dataclass
class MigrationOrder:
    """The moves from one source worker to one destination: ``moves`` are ``(sequence, destination
    block ids, shared)`` in order, ``shared`` the leading blocks the destination's prefix cache holds
    already (their K/V is not sent)."""

    source: str
    dest: str
    moves: list[tuple[Sequence, list[int], int]] = field(default_factory=list)


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
        prefix_hit: Callable[[WorkerSlot, Sequence], list[int]] = lambda slot, seq: [],
    ):
        self.config = config
        self.prefix_hit = prefix_hit  # a worker's cached blocks holding a sequence's prefix
        self.registry = registry
        self.lifecycle = lifecycle
        self.counters = counters
        self.pending: dict[str, int] = {}  # source worker -> orders not answered yet
        self.draining_round: dict[str, bool] = {}  # source worker -> its round is a drain's
        self.balanced_at = 0.0  # when rebalancing was last considered (``time.monotonic``)
        self.balance_interval = BALANCE_INTERVAL_S  # seconds between two considerations

    def wanted(self, slot: WorkerSlot) -> bool:
        """``slot`` gets no plan: its round of moves is under way, or it is due (a rebalancing round
        planned, or it drains with migration on and its drain round is not over) and starts once
        nothing of it is in flight. Only for a handle that migrates."""
        if not hasattr(slot.handle, "migrate"):
            return False
        if slot.migration is MigrationPhase.MOVING or slot.balance:
            return True
        return (
            slot.draining
            and self.config.migration != "off"
            and slot.migration is MigrationPhase.NONE
            and bool(slot.running)
        )

    def rebalance(self, now: float) -> str | None:
        """With ``migration="balance"``, at most every ``balance_interval`` seconds (``now``: monotonic
        seconds): plan a round of moves off the worker with the longest queue delay
        (``rebalance.plan_rebalance``) into its ``balance``; the engine core starts it once nothing
        of that worker is in flight. Returns that worker's name, or None."""
        config = self.config
        if config.migration != "balance" or now - self.balanced_at < self.balance_interval:
            return None
        self.balanced_at = now
        plan = plan_rebalance(config, [s for s in self.registry.slots.values() if balances(config, s)])
        if plan is None:
            return None
        source, moves = plan
        source.balance = moves
        self.registry.touched.add(source.name)
        log.info("rebalancing: %d sequences to move off %s", len(moves), source.name)
        return source.name

    def start(self, name: str) -> list[MigrationOrder]:
        """Plan ``name``'s round of moves (no plan of it in flight): every sequence of a draining
        worker, else the rebalancing moves planned (``slot.balance``); returns one order per
        destination (none: the round is over at once)."""
        slot = self.registry.slots[name]
        planned, slot.balance = slot.balance or {}, None
        drain = slot.draining
        orders: dict[str, MigrationOrder] = {}
        adapters: dict[str, set[str]] = {}  # destination -> LoRA adapters moved there this round
        for seq in list(slot.running):
            if seq.params.prompt_logprobs is not None or not (drain or seq.seq_id in planned):
                continue  # its scorer's state does not move, or it is not to move: it stays
            dest = self._destination(slot, seq, adapters, None if drain else planned[seq.seq_id])
            if dest is None:
                continue  # no room anywhere (or no other worker): it stays here
            if seq.num_computed_tokens <= seq.num_start_tokens:
                self.lifecycle.to_waiting(seq)  # nothing computed here yet: it starts elsewhere
                continue
            if seq.lora is not None:
                adapters.setdefault(dest.name, set()).add(seq.lora)
            # blocks for all its tokens (a prompt's continuing chunks bring none), starting from the
            # destination's cached blocks of its computed prefix: shared, not sent
            shared = self.prefix_hit(dest, seq)[: seq.num_computed_tokens // dest.account.block_size]
            dest.account.reserve(seq.seq_id, seq.num_tokens, shared)
            order = orders.setdefault(dest.name, MigrationOrder(name, dest.name))
            order.moves.append((seq, dest.account.unsent(seq.seq_id), len(shared)))
        done = MigrationPhase.DONE if drain else MigrationPhase.NONE
        slot.migration = MigrationPhase.MOVING if orders else done
        self.draining_round[name] = drain
        self.pending[name] = len(orders)
        self.registry.touched.add(name)
        return list(orders.values())

    def _destination(
        self, source: WorkerSlot, seq: Sequence, adapters: dict[str, set[str]], only: str | None
    ) -> WorkerSlot | None:
        """Where ``seq`` goes: among the workers with room (``only``: that one alone), the one with the
        largest share of free blocks; None when none has room."""
        need = seq.num_tokens  # its K/V, the rest of its prompt or the block of its next decode
        fits = [
            s
            for s in self.registry.slots.values()
            if s is not source
            and (only is None or s.name == only)
            and not s.draining
            and s.account.can_reserve(seq.seq_id, need, self.config.watermark_blocks)
            and len(s.running) < self.config.max_num_seqs
            and s.lora_fits(seq, self.config.max_loras, adapters.get(s.name, set()))
        ]
        return max(fits, key=lambda s: s.account.num_free / s.account.num_blocks, default=None)

    def done(self, order: MigrationOrder, result: MigrationResult | Exception) -> None:
        """Apply a source worker's answer: re-point each moved sequence to its destination; give the
        destination blocks of the others back (they stay on the source, or, when the source is gone,
        they were put back in the queue already)."""
        moved = set() if isinstance(result, Exception) else set(result.moved)
        src, dst = self.registry.slots.get(order.source), self.registry.slots.get(order.dest)
        for seq, _, _ in order.moves:
            here = src is not None and seq.status is SeqStatus.RUNNING and seq.worker == order.source
            if seq.seq_id in moved and here and dst is not None:
                src.account.release(seq.seq_id)  # the source worker dropped its copy itself
                src.running.remove(seq)
                dst.running.append(seq)
                seq.worker = dst.name
                dst.num_admitted += 1
                self.counters.num_migrated += 1
                self.counters.num_rebalanced += not self.draining_round.get(order.source, True)
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
            drained = self.draining_round.get(order.source, True)
            src.migration = MigrationPhase.DONE if drained else MigrationPhase.NONE
            self.registry.touched.add(src.name)
