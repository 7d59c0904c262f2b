"""The waiting queue with admission and placement of its sequences (SplitFuse rule 2).

A queued sequence is admitted onto a worker only when blocks exist for its whole remaining prompt
(past the prefix its worker already caches) plus a watermark; among the workers that can take it,
it goes where it is expected to finish soonest (``fuseserve.scheduler.placement``), or waits for a
busier worker that would finish it sooner; with prefix-aware placement, where most of its prompt is
cached among the workers loaded near the least.
"""

from __future__ import annotations

import collections
import itertools

from fuseserve.block_hash import root_hash
from fuseserve.config import EngineConfig
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.placement import (
    StepTimeModel,
    expected_finish,
    near_least_loaded,
    seconds_per_share,
)
from fuseserve.scheduler.sequence import SeqStatus, Sequence
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import WorkerSlot


class WaitingQueue:
    """Sequences waiting for a worker (``waiting``, FIFO; a preempted one goes back to the front),
    admitted onto the workers of ``registry``; prefix-cache lookups are counted in ``counters``.

    model_id: part of every block hash (``fuseserve/block_hash.py``), set by the adapter.
    """

    def __init__(self, config: EngineConfig, registry: WorkerRegistry, counters: SchedulerCounters):
        self.config = config
        self.registry = registry
        self.counters = counters
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.model_id = ""
        self._admit_counter = itertools.count()

    def block_hashes(self, seq: Sequence, block_size: int) -> list[int]:
        """The hashes of ``seq``'s full blocks, rooted in the model, its LoRA adapter and its cache
        salt (K/V computed under one adapter never serves another, nor the base model)."""
        extra = (f"lora:{seq.lora}",) if seq.lora is not None else ()
        return seq.full_block_hashes(block_size, root_hash(self.model_id, seq.cache_salt, extra))

    def lora_fits(self, slot: WorkerSlot, seq: Sequence) -> bool:
        """``seq``'s LoRA adapter may join ``slot`` (``WorkerSlot.lora_fits``, ``max_loras`` slots)."""
        return slot.lora_fits(seq, self.config.max_loras)

    def can_admit(self, slot: WorkerSlot, seq: Sequence, extra_blocks: int = 0) -> bool:
        """Rule 2: blocks for the whole remaining prompt (past its cached prefix) plus the watermark
        (plus ``extra_blocks``), and a free sequence slot, on a worker that is not draining and has
        room for its LoRA adapter (``lora_fits``)."""
        return (
            not slot.draining
            and len(slot.running) < self.config.max_num_seqs
            and self.lora_fits(slot, seq)
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
        return slot.account.match(self.block_hashes(seq, bs), max_blocks)

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
            self.counters.num_prefix_queries += seq.num_tokens
            self.counters.num_prefix_hits += seq.num_start_tokens
        seq.status = SeqStatus.RUNNING
        seq.worker = slot.name
        seq.admitted_at = next(self._admit_counter)
        seq.num_tokens_at_admission = seq.num_tokens
        slot.running.append(seq)
        if seq.lora is not None:
            slot.note_lora(seq.lora, self.config.max_loras)
        slot.num_admitted += 1
        self.registry.touched.add(slot.name)

    def place(
        self, seq: Sequence, here: list[WorkerSlot], elsewhere: bool, planning: list[WorkerSlot]
    ) -> WorkerSlot | None:
        """The worker expected to finish ``seq`` soonest, or None when it cannot be placed now.

        ``here``: workers being planned whose pass has room for the prompt. ``elsewhere``: workers
        not being planned (``planning``) are candidates too, while their queued prompt tokens are
        under one pass (a prompt is bound to a worker at most a pass ahead) and they keep a block per
        running sequence for its next decode. Every candidate must pass rule 2. Soonest: the smallest
        ``placement.expected_finish`` (its prompt and output on that worker, from the worker's
        measured pass times, running sequences, queued prompts and plans in flight); ties (no
        measurement yet) go to the worker with the larger share of free blocks, then fewer running
        sequences. None too when ``seq`` waits for a faster worker (``_waits_for_faster``). Among
        the workers loaded near the least (``placement.near_least_loaded``: the balance guard), one
        caching more of the prompt (with prefix-aware placement) wins, then one where ``seq``'s LoRA
        adapter is resident (``lora_resident``: no slot to load, no slot taken from another adapter;
        with ``lora_aware_placement``).
        """
        candidates = [s for s in here if self.can_admit(s, seq)]
        if elsewhere:
            for slot in self.registry.slots.values():
                if (
                    slot not in planning
                    and self._queued_prompt_tokens(slot) < slot.token_budget
                    and self.can_admit(slot, seq, extra_blocks=len(slot.running))
                ):
                    candidates.append(slot)
        if not candidates:
            return None
        measured = [s.step_time for s in self.registry.slots.values() if s.step_time.seconds(1) is not None]
        fallback = measured[0] if measured else None
        finish = [self._expected_finish(s, seq, fallback) for s in candidates]
        if self._waits_for_faster(seq, candidates, min(finish), fallback):
            return None
        if len(candidates) == 1:
            return candidates[0]

        def key(i: int):
            s = candidates[i]
            return (round(finish[i], 9), -s.account.num_free / s.account.num_blocks, len(s.running))

        order = range(len(candidates))
        hits = [0] * len(candidates)
        if self.config.enable_prefix_caching and self.config.prefix_aware_placement:
            hits = [len(self.prefix_hit(s, seq)) for s in candidates]
        resident = [self.config.lora_aware_placement and self.lora_resident(s, seq) for s in candidates]
        if any(hits) or any(resident):  # follow the prefix, then the adapter, among the near least loaded
            shares = [
                seconds_per_share(s.step_time, fallback, s.token_budget, len(s.running)) for s in candidates
            ]
            near = near_least_loaded(shares, [len(s.running) for s in candidates])
            best = min((i for i in order if near[i]), key=lambda i: (-hits[i], -resident[i], key(i)))
            return candidates[best]
        return candidates[min(order, key=key)]

    def _waits_for_faster(
        self, seq: Sequence, candidates: list[WorkerSlot], soonest: float, fallback: StepTimeModel | None
    ) -> bool:
        """Whether ``seq`` should wait for a worker that is no candidate now (its pass or queue is
        full) but could take it: one expected to finish it sooner than ``soonest`` (the best
        candidate's), so a sequence is not put on a slow worker that a fast one would finish first.
        Unless the queue behind ``seq`` is long: the waiting sequences are alike, so placing ``seq``
        on the candidate now is as good as placing the queue's last one there, and that one, with
        every queued prompt ahead of it on the faster worker, would finish later there."""
        behind = None
        for slot in self.registry.slots.values():
            if (
                slot not in candidates
                and self.can_admit(slot, seq)
                and self._expected_finish(slot, seq, fallback) < soonest
            ):
                if behind is None:
                    behind = sum(s.num_tokens for s in self.waiting if s is not seq)
                if self._expected_finish(slot, seq, fallback, behind) < soonest:
                    return True
        return False

    def _expected_finish(
        self, slot: WorkerSlot, seq: Sequence, fallback: StepTimeModel | None, ahead: int = 0
    ) -> float:
        """``placement.expected_finish`` of ``seq`` on ``slot`` (its cached prefix not computed), with
        ``ahead`` more prompt tokens queued there before it."""
        cached = len(self.prefix_hit(slot, seq)) * slot.account.block_size
        return expected_finish(
            slot.step_time,
            fallback,
            slot.token_budget,
            len(slot.running),
            self._queued_prompt_tokens(slot) + ahead,
            [f.num_tokens for f in slot.inflight],
            seq.num_tokens - cached,
            seq.params.max_new_tokens - len(seq.output_token_ids),
        )

    @staticmethod
    def lora_resident(slot: WorkerSlot, seq: Sequence) -> bool:
        """``seq`` runs with a LoRA adapter that sits in one of ``slot``'s adapter slots: one of its
        running sequences runs with it, or it is still there, idle (``WorkerSlot.lora_recent``)."""
        if seq.lora is None:
            return False
        return seq.lora in slot.lora_recent or any(s.lora == seq.lora for s in slot.running)

    @staticmethod
    def _queued_prompt_tokens(slot: WorkerSlot) -> int:
        """Prompt tokens placed on ``slot`` that no plan has taken yet."""
        return sum(seq.num_uncomputed for seq in slot.running if seq.in_prefill)

    def least_loaded(self, candidates: list[WorkerSlot]) -> WorkerSlot:
        """The worker with the most free blocks (in proportion), then the fewest running sequences."""
        return max(candidates, key=lambda s: (s.account.num_free / s.account.num_blocks, -len(s.running)))
