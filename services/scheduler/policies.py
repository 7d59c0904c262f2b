"""Scheduling policies behind one interface, so the benchmark compares them on the same engine.

A policy builds the next pass of the workers being planned together (one, when results arrive one
by one; several, when they are free at the same time) and returns one ``Draft`` per worker
(``[(sequence, num_tokens)]`` within the token budget); it never writes to the scheduler's worker
slots. It asks the
pass builder to reserve blocks and preempt, and the builder's waiting queue to place and admit
(they own that state).

- ``splitfuse`` (DeepSpeed-FastGen, paper §3.3): decodes, then continuing prompt chunks, then new
  prompts, filling the token budget exactly; long prompts are split over passes. New prompts are
  placed on the worker expected to serve them soonest (``WaitingQueue.place``), which may be another
  worker than the one being planned: the prompt then runs there with that worker's next pass.
- ``prefill_first`` (vLLM v0, TGI before chunking): a pass of whole new prompts whenever one can be
  admitted, otherwise a pass of decodes; prompts and decodes never share a pass.
- ``whole_prompt`` (Orca): decodes fused with whole new prompts; a prompt is never split. The first
  prompt of a pass is taken even when it does not fit the budget left (otherwise running decodes
  would starve it), so such a pass exceeds the budget by at most that one prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fuseserve.scheduler.pass_builder import PassBuilder
    from fuseserve.scheduler.sequence import Sequence
    from fuseserve.scheduler.worker_slot import WorkerSlot


@dataclass
class Draft:
    """The pass being built for one worker.

    token_budget: tokens the pass may hold; max_num_seqs: sequences it may hold.
    entries: ``(sequence, num_tokens)`` in plan order (grown with ``add``, shrunk with ``drop``).
    num_tokens: tokens in ``entries`` so far.
    blocked: a running sequence wanted a KV block and none could be had (no victim to preempt).
    """

    token_budget: int
    max_num_seqs: int
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    blocked: bool = False
    num_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        """Append ``num_tokens`` of ``seq`` to the pass."""
        self.entries.append((seq, num_tokens))
        self.num_tokens += num_tokens

    @property
    def budget_left(self) -> int:
        """Tokens still free in the pass."""
        return self.token_budget - self.num_tokens

    @property
    def has_room(self) -> bool:
        """Another sequence fits: a token and a sequence slot are left."""
        return self.num_tokens < self.token_budget and len(self.entries) < self.max_num_seqs

    def drop(self, seq: Sequence) -> None:
        """Take ``seq`` out of the pass (it was preempted while the pass was built)."""
        self.entries = [(s, n) for s, n in self.entries if s is not seq]
        self.num_tokens = sum(n for _, n in self.entries)

    def has_prompt(self) -> bool:
        return any(seq.in_prefill for seq, _ in self.entries)


class Policy(ABC):
    name = "abstract"
    #: new prompts may be placed on a worker not being planned (they then run there as continuing
    #: prompt chunks, which only a policy that continues chunks schedules)
    places_elsewhere = False
    #: with latency targets, each pass's budget comes from ``slo_budget`` (else the fixed budget)
    sized_by_slo = False

    @abstractmethod
    def plan(self, builder: PassBuilder, slots: list[WorkerSlot]) -> dict[str, Draft]:
        """The next pass of each worker of ``slots``, by worker name."""


def schedule_decodes(builder: PassBuilder, slot: WorkerSlot, draft: Draft) -> list[Sequence]:
    """One token per running sequence past its prompt, oldest first (rule 1), growing blocks (rule 3).

    A sequence whose plan in flight ends it by length (``max_new_tokens`` or the context window) is
    not planned again: its token would be surplus.

    Returns the running sequences in prefill passed over, in admission order (all of them, unless
    the pass filled up first: then no prompt chunk fits anyway).
    """
    # the per-step hot path: ``Sequence.in_prefill`` / ``num_planned_tokens`` and
    # ``Sequence.ends_in_flight`` computed inline, and a sequence whose blocks already hold its next
    # token (``BlockAccount.covers``) needs no reservation
    account = slot.account
    max_model_len = builder.registry.max_model_len
    name = slot.name
    entries = draft.entries
    prompts = []
    for seq in list(slot.running):
        if seq.worker != name:  # preempted by an older sequence of this loop
            continue
        num_out = len(seq.output_token_ids)
        pending = seq.num_pending
        planned = len(seq.prompt_token_ids) + num_out + pending
        if planned - seq.num_computed_tokens > 1 or not (num_out or pending):
            prompts.append(seq)  # in prefill
            continue
        if pending and (num_out + pending >= seq.params.max_new_tokens or planned >= max_model_len):
            continue  # ends in flight
        if draft.num_tokens >= draft.token_budget or len(entries) >= draft.max_num_seqs:
            return prompts
        if account.covers(seq.seq_id, planned) or builder.reserve_or_preempt(slot, seq, planned, draft):
            entries = draft.entries  # ``drop`` may have replaced the list
            entries.append((seq, 1))
            draft.num_tokens += 1
        else:
            entries = draft.entries
            draft.blocked = True
    return prompts


def continue_prompts(
    slot: WorkerSlot,
    draft: Draft,
    key: Callable[[Sequence], float] | None = None,
    prompts: list[Sequence] | None = None,
) -> None:
    """Continuing prompt chunks (their blocks were reserved at admission), in admission order, or
    by ``key`` (earliest TTFT deadline first with latency targets). ``prompts``: the candidates
    ``schedule_decodes`` passed over (default: every running sequence)."""
    candidates = slot.running if prompts is None else [s for s in prompts if s.worker == slot.name]
    for seq in sorted(candidates, key=key) if key else candidates:
        if seq.in_prefill and draft.has_room:
            draft.add(seq, min(seq.num_uncomputed, draft.budget_left))


def admit_new(
    builder: PassBuilder,
    slots: list[WorkerSlot],
    drafts: dict[str, Draft],
    split: bool,
    fits: Callable[[Draft, int], bool] | None,
) -> None:
    """Admit queued sequences in FIFO order (rule 2) while the head can be placed somewhere.

    ``split``: cut the last prompt to the budget left; else whole prompts only, when ``fits(draft, n)``.
    A sequence placed on a worker being planned joins its draft; one placed on another worker runs
    with that worker's next pass. A sequence whose LoRA adapter no worker has room for
    (``WaitingQueue.lora_fits``: ``max_loras`` other adapters running everywhere) is passed over,
    and stays at its place in the queue.
    """
    queue = builder.queue
    skipped = 0  # queued sequences passed over for their adapter
    while len(queue.waiting) > skipped:
        seq = queue.waiting[skipped]
        here = [
            s
            for s in slots
            if len(drafts[s.name].entries) < drafts[s.name].max_num_seqs
            and (drafts[s.name].budget_left > 0 if split else fits(drafts[s.name], seq.num_tokens))
        ]
        target = queue.place(seq, here, elsewhere=builder.policy.places_elsewhere, planning=slots)
        if target is None:
            if seq.lora is not None and not any(
                queue.lora_fits(s, seq) for s in builder.registry.slots.values()
            ):
                skipped += 1
                continue
            return
        queue.admit(target, seq)
        draft = drafts.get(target.name)
        if draft is not None:
            # a cached prefix counts as computed: the pass runs only the rest (``num_uncomputed``)
            draft.add(seq, min(seq.num_uncomputed, draft.budget_left) if split else seq.num_uncomputed)


class SplitFuse(Policy):
    name = "splitfuse"
    places_elsewhere = True
    sized_by_slo = True

    def plan(self, builder: PassBuilder, slots: list[WorkerSlot]) -> dict[str, Draft]:
        key = None
        slo = builder.slo
        if slo is not None and slo.target_prefill_rate is not None:
            # waiting prompts earliest TTFT deadline first; the overdue last when the KV cache is short
            free = sum(
                s.account.num_free * s.account.block_size for s in builder.queue.registry.slots.values()
            )
            slo.order_waiting(builder.queue.waiting, free)
            key = slo.deadline
        drafts = {s.name: builder.new_draft(s) for s in slots}
        for slot in slots:
            prompts = schedule_decodes(builder, slot, drafts[slot.name])
            continue_prompts(slot, drafts[slot.name], key, prompts)
        admit_new(builder, slots, drafts, split=True, fits=None)
        return drafts


class WholePrompt(Policy):
    name = "whole_prompt"

    def plan(self, builder: PassBuilder, slots: list[WorkerSlot]) -> dict[str, Draft]:
        drafts = {s.name: builder.new_draft(s) for s in slots}
        for slot in slots:
            schedule_decodes(builder, slot, drafts[slot.name])
        # like Orca, a prompt is never starved by running decodes: the first prompt of a pass is
        # taken whole even past the budget; further prompts only while they fit
        admit_new(
            builder, slots, drafts, split=False, fits=lambda d, n: n <= d.budget_left or not d.has_prompt()
        )
        return drafts


class PrefillFirst(Policy):
    name = "prefill_first"

    def plan(self, builder: PassBuilder, slots: list[WorkerSlot]) -> dict[str, Draft]:
        drafts = {s.name: builder.new_draft(s) for s in slots}
        admit_new(builder, slots, drafts, split=False, fits=lambda d, n: n <= d.budget_left or not d.entries)
        for slot in slots:
            if not drafts[slot.name].entries:
                schedule_decodes(builder, slot, drafts[slot.name])
        return drafts


_POLICIES = {p.name: p for p in (SplitFuse, WholePrompt, PrefillFirst)}


def get_policy(name: str) -> Policy:
    """Policy by name; raises ``KeyError`` listing the choices."""
    if name not in _POLICIES:
        raise KeyError(f"unknown policy {name!r}; choose from {', '.join(_POLICIES)}")
    return _POLICIES[name]()
