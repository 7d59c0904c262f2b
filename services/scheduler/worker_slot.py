"""One worker as the scheduler sees it (``WorkerSlot``) and its plans in flight (``InFlight``)."""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.placement import StepTimeModel
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.slo_budget import PassLatency
from fuseserve.types import StepPlan


class MigrationPhase(enum.Enum):
    """Where a worker is in its round of KV migration (``fuseserve.scheduler.migration``): a draining
    worker's one round, or a rebalancing round (after which it is back to NONE)."""

    NONE = "none"  # no round under way (or migration is off)
    MOVING = "moving"  # moves sent, answers awaited: the worker is not planned
    DONE = "done"  # a draining worker's round is over: what stayed finishes there


@dataclass
class InFlight:
    """A plan sent to a worker and not answered yet.

    entries: ``(sequence, num_tokens, admitted_at)``; a result applies to a sequence only while it is
    still running on that worker under the same admission (not preempted, moved or finished since).
    hashed: blocks this plan fills that were added to the prefix cache when it was built.
    num_tokens: tokens in the plan (``plan.num_tokens``, counted once).
    passes: with ``plan.num_passes > 1``, the passes planned per sequence id (``multi_pass_plan.py``).
    """

    plan: StepPlan
    entries: list[tuple[Sequence, int, int]]
    hashed: list[int] = field(default_factory=list)
    num_tokens: int = 0
    passes: dict[int, int] | None = None


@dataclass
class WorkerSlot:
    """One worker as the engine sees it: capacity, running sequences, plans in flight, its handle.

    handle: how plans reach the worker (``fuseserve.scheduler.engine_core.WorkerHandle``), held here
        only: the engine core's lanes and the service's leases look it up; None for a scheduler used
        without transport.
    num_steps: plans sent so far; the next plan's ``step_id`` (a worker runs plans in step order).
    step_time: measured seconds per pass against tokens per pass (placement).
    latency: predicted seconds of a pass of a given shape, corrected from measured passes (used with
        latency targets, ``fuseserve.scheduler.slo_budget``).
    lora_adapters: the LoRA adapters the worker serves, as it reported them (its Redis record); None:
        not reported (an in-process runner built from the engine's own ``lora_modules``).
    lora_recent: the adapters its ``max_loras`` adapter slots hold as far as the scheduler knows
        (``note_lora``), least recently placed first: a mirror of the worker's ``LoRAManager``.
    decode_passes: the most decode passes one of its plans may take (``multi_pass_plan.py``).
    """

    name: str
    account: BlockAccount
    token_budget: int
    max_model_len: int
    handle: Any = None
    lora_adapters: frozenset[str] | None = None
    running: list[Sequence] = field(default_factory=list)  # admission order
    pending_free: list[int] = field(default_factory=list)
    inflight: collections.deque[InFlight] = field(default_factory=collections.deque)
    num_admitted: int = 0  # sequences admitted onto this worker so far (recomputes included)
    num_steps: int = 0
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    latency: PassLatency = field(default_factory=PassLatency)
    poisoned_through: int = -1  # plans up to this step id were built on a plan that failed
    draining: bool = False  # the worker is stopping: its running sequences finish, no new ones come
    lora_recent: list[str] = field(default_factory=list)
    migration: MigrationPhase = MigrationPhase.NONE  # its round of KV migration (drain or balance)
    balance: dict[int, str] | None = None  # a rebalancing round planned: sequence id -> destination
    decode_passes: int = 1

    def serves_lora(self, lora: str) -> bool:
        """The worker serves adapter ``lora`` (or did not report its adapters)."""
        return self.lora_adapters is None or lora in self.lora_adapters

    def lora_fits(
        self, seq: Sequence, max_loras: int, moving: set[str] | frozenset[str] = frozenset()
    ) -> bool:
        """``seq``'s LoRA adapter may join this worker (with the adapters ``moving`` here too): the base
        model (counts as none), or an adapter the worker serves that one of its running sequences runs
        with, or a new one while they hold fewer than ``max_loras``. Every pass then holds at most
        ``max_loras`` distinct adapters, and the worker has a slot for each."""
        if seq.lora is None:
            return True
        if not self.serves_lora(seq.lora):
            return False
        held = {s.lora for s in self.running if s.lora is not None} | moving
        return seq.lora in held or len(held) < max_loras

    def note_lora(self, name: str, max_loras: int) -> None:
        """A sequence of adapter ``name`` was placed here: the worker loads it into a slot unless one
        holds it, evicting its least recently used adapter that no running sequence uses
        (``LoRAManager.slot``); ``lora_recent`` follows. An approximation: the worker orders its
        slots by last pass, this by last placement."""
        if name in self.lora_recent:
            self.lora_recent.remove(name)
        self.lora_recent.append(name)
        running = {s.lora for s in self.running}
        for old in list(self.lora_recent[:-1]):
            if len(self.lora_recent) <= max_loras:
                break
            if old not in running:
                self.lora_recent.remove(old)
