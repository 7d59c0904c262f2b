"""Scheduling policies behind one interface, so the benchmark compares them on the same engine.

- ``splitfuse`` (DeepSpeed-FastGen, paper §3.3): decodes, then continuing prompt chunks, then new
  prompts, filling the token budget exactly; long prompts are split over passes.
- ``prefill_first`` (vLLM v0, TGI before chunking): a pass of whole new prompts whenever one can be
  admitted, otherwise a pass of decodes; prompts and decodes never share a pass.
- ``whole_prompt`` (Orca): decodes fused with whole new prompts; a prompt is never split. The first
  prompt of a pass is taken even when it does not fit the budget left (otherwise running decodes
  would starve it), so such a pass exceeds the budget by at most that one prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fuseserve.scheduler.scheduler import Scheduler, WorkerSlot


class Policy(ABC):
    name = "abstract"

    @abstractmethod
    def schedule(self, sched: Scheduler) -> None:
        """Fill ``slot.entries`` ``[(sequence, num_tokens)]`` of every worker slot of ``sched``."""


def schedule_decodes(sched: Scheduler, slot: WorkerSlot) -> None:
    """One token per running sequence past its prompt, oldest first (rule 1), growing blocks (rule 3)."""
    for seq in list(slot.running):
        if seq.in_prefill or seq not in slot.running:
            continue
        if slot.budget_left < 1 or len(slot.entries) >= sched.config.max_num_seqs:
            return
        if sched.reserve_or_preempt(slot, seq, seq.num_tokens):
            slot.entries.append((seq, 1))


def admit_new(sched: Scheduler, split: bool, fits) -> None:
    """Admit queued sequences in FIFO order onto the least-loaded worker that can take them (rule 2).

    ``split``: cut the last prompt to the budget left; else whole prompts only, when ``fits(slot, n)``.
    """
    while sched.waiting:
        seq = sched.waiting[0]
        candidates = [
            s
            for s in sched.slots.values()
            if len(s.entries) < sched.config.max_num_seqs
            and sched.can_admit(s, seq)
            and (s.budget_left > 0 if split else fits(s, seq.num_tokens))
        ]
        if not candidates:
            return
        slot = sched.least_loaded(candidates)
        sched.admit(slot, seq)
        slot.entries.append((seq, min(seq.num_tokens, slot.budget_left) if split else seq.num_tokens))


class SplitFuse(Policy):
    name = "splitfuse"

    def schedule(self, sched: Scheduler) -> None:
        for slot in sched.slots.values():
            schedule_decodes(sched, slot)
            for seq in slot.running:  # continuing prompt chunks (their blocks are reserved)
                if seq.in_prefill and slot.budget_left > 0 and len(slot.entries) < sched.config.max_num_seqs:
                    slot.entries.append((seq, min(seq.num_uncomputed, slot.budget_left)))
        admit_new(sched, split=True, fits=None)


class WholePrompt(Policy):
    name = "whole_prompt"

    def schedule(self, sched: Scheduler) -> None:
        for slot in sched.slots.values():
            schedule_decodes(sched, slot)
        # like Orca, a prompt is never starved by running decodes: the first prompt of a pass is
        # taken whole even past the budget; further prompts only while they fit
        admit_new(sched, split=False, fits=lambda s, n: n <= s.budget_left or not _has_prompt(s))


def _has_prompt(slot: WorkerSlot) -> bool:
    return any(seq.in_prefill for seq, _ in slot.entries)


class PrefillFirst(Policy):
    name = "prefill_first"

    def schedule(self, sched: Scheduler) -> None:
        admit_new(sched, split=False, fits=lambda s, n: n <= s.budget_left or not s.entries)
        for slot in sched.slots.values():
            if not slot.entries:
                schedule_decodes(sched, slot)


_POLICIES = {p.name: p for p in (SplitFuse, WholePrompt, PrefillFirst)}


def get_policy(name: str) -> Policy:
    """Policy by name; raises ``KeyError`` listing the choices."""
    if name not in _POLICIES:
        raise KeyError(f"unknown policy {name!r}; choose from {', '.join(_POLICIES)}")
    return _POLICIES[name]()
