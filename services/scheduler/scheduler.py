"""The SplitFuse planner: builds one worker's next pass within its token budget (paper §3).

Lifecycle per worker: ``schedule_worker`` (a plan, marked in flight) → the worker runs it →
``postprocess`` (tokens, stops) or ``fail_plan``. Each worker is planned on its own, whenever it has
room for a plan; with overlap its next plan is built while the current one runs, so plans in flight
may hold tokens not known yet (``Sequence.num_pending``): such a sequence is planned as a decode
entry, fed by the worker with the token it sampled last.

Works in counts and ids only: token counts per sequence, free-block counts per worker. The
SplitFuse rules:

1. decode tokens first (one per running sequence), then continuing prompt chunks, then new prompts,
   filling the budget exactly; the last prompt taken is cut to fit;
2. a prompt is admitted only when blocks exist for its whole remaining prompt plus a watermark;
3. a running sequence that cannot get a block preempts the most recently admitted sequence
   (recompute later from prompt + generated tokens); at most ``max_preemptions`` per sequence.

A stop learned one pass late (EOS or a stop token sampled by plan N while plan N+1 already feeds
it) leaves one surplus token: it is dropped here (the sequence is finished, so no event is made)
and the sequence's blocks are freed with the worker's next plan. Length stops are never late: a
sequence whose plan in flight reaches ``max_new_tokens`` is not planned again.

With ``decode_passes > 1`` a plan of decodes only may run several passes on the worker
(multi-step decoding, ``fuseserve.scheduler.multi_pass_plan``).

``prefill_first`` (vLLM v0, TGI before chunking) and ``whole_prompt`` (Orca) are the same machinery
with different choices (``fuseserve.scheduler.policies``).

``Scheduler`` composes the parts that own their state, and its methods are calls on them: the
workers (``worker_registry.WorkerRegistry``, each a ``worker_slot.WorkerSlot``), the waiting queue
with admission and placement (``waiting_queue.WaitingQueue``), the live sequences and their moves
(``seq_lifecycle.SeqLifecycle``), the pass builder with the policies, the SLO budget and
multi-pass (``pass_builder.PassBuilder``), and the result applier (``result_applier.ResultApplier``);
each worker's blocks are its ``block_accounting.BlockAccount``. Events are counted in one
``core_stats.SchedulerCounters``, read and reset by ``make_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fuseserve.config import EngineConfig
from fuseserve.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    LoRAAdapterNotServedError,
    SchedulerError,
)
from fuseserve.pass_shape import PassShape
from fuseserve.scheduler import multi_pass_plan
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.scheduler.core_stats import SchedulerCounters
from fuseserve.scheduler.migration import Migrations
from fuseserve.scheduler.pass_builder import PassBuilder
from fuseserve.scheduler.policies import Draft, get_policy
from fuseserve.scheduler.result_applier import ResultApplier
from fuseserve.scheduler.seq_lifecycle import SeqLifecycle
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence
from fuseserve.scheduler.slo_budget import PassLatency, SLOBudget
from fuseserve.scheduler.waiting_queue import WaitingQueue
from fuseserve.scheduler.worker_registry import WorkerRegistry
from fuseserve.scheduler.worker_slot import InFlight, WorkerSlot
from fuseserve.types import StepPlan, StepResult, TokenEvent

__all__ = ["InFlight", "Scheduler", "TokenEvent", "WorkerSlot"]  # re-exported (engine core, policies)


class Scheduler:
    """Plans passes for each worker and applies token-level stops.

    Args:
        config: token_budget (None → each worker's own, chosen by profiling), max_num_seqs,
            watermark_blocks, max_preemptions, policy.
        eos_token_ids: the model's EOS ids (generation config).
        clock: seconds, for TTFT deadlines (a simulation passes its simulated clock).

    ``pass_observers`` are called with ``(worker, token_budget, num_tokens)`` for every plan built:
    the budget chosen for the pass and the tokens it holds (metrics, benchmarks).
    """

    def __init__(
        self, config: EngineConfig, eos_token_ids: list[int], clock: Callable[[], float] = time.monotonic
    ):
        config.validate()
        self.config = config
        self.clock = clock
        self.slo: SLOBudget | None = None
        if config.target_itl is not None or config.target_prefill_rate is not None:
            self.slo = SLOBudget(config.target_itl, config.target_prefill_rate, clock)
        self.counters = SchedulerCounters()  # events since the last ``make_stats``
        self._reported = SchedulerCounters()  # the events of the records made so far
        self.registry = WorkerRegistry()
        self.queue = WaitingQueue(config, self.registry, self.counters)
        self.lifecycle = SeqLifecycle(self.registry, self.queue.waiting, self.counters)
        self.migrations = Migrations(
            config, self.registry, self.lifecycle, self.counters, self.queue.prefix_hit
        )
        policy = get_policy(config.policy)
        self.builder = PassBuilder(
            config, policy, self.slo, self.registry, self.queue, self.lifecycle, self.counters
        )
        self.applier = ResultApplier(
            self.registry, self.lifecycle, self.counters, set(eos_token_ids), self.slo is not None
        )

    # ----- the managers' state, by its old names -----
    slots = property(lambda self: self.registry.slots, doc="Worker name → ``WorkerSlot``.")
    touched = property(lambda self: self.registry.touched, doc="Workers given work since the last dispatch.")
    waiting = property(lambda self: self.queue.waiting, doc="Sequences waiting for a worker, FIFO.")
    seqs = property(lambda self: self.lifecycle.seqs, doc="Every sequence not finished, by id.")
    policy = property(lambda self: self.builder.policy, doc="The scheduling policy.")
    pass_observers = property(lambda self: self.builder.pass_observers, doc="Called for every plan built.")

    @property
    def model_id(self) -> str:
        """Part of every block hash (``fuseserve/block_hash.py``)."""
        return self.queue.model_id

    @model_id.setter
    def model_id(self, value: str) -> None:
        self.queue.model_id = value

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's EOS ids."""
        return self.applier.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: set[int]) -> None:
        self.applier.eos_token_ids = set(value)

    # ----- stats -----
    def make_stats(self) -> SchedulerCounters:
        """The events counted since the previous call, read and reset (``totals`` goes on)."""
        new = self.counters.take()
        self._reported.add(new)
        return new

    def totals(self) -> SchedulerCounters:
        """Every event counted so far."""
        totals = SchedulerCounters()
        totals.add(self._reported)
        totals.add(self.counters)
        return totals

    # each total so far, by its ``SchedulerCounters`` name
    num_preemptions = property(lambda self: self.totals().num_preemptions)
    num_forced_preemptions = property(lambda self: self.totals().num_forced_preemptions)
    num_surplus_tokens = property(lambda self: self.totals().num_surplus_tokens)
    num_prefix_queries = property(lambda self: self.totals().num_prefix_queries)
    num_prefix_hits = property(lambda self: self.totals().num_prefix_hits)
    num_recomputed_tokens = property(lambda self: self.totals().num_recomputed_tokens)
    num_migrated = property(lambda self: self.totals().num_migrated)

    # ----- workers -----
    def add_worker(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_budget: int | None = None,
        handle: Any = None,
        latency_prior: Callable[[PassShape], float] | None = None,
        lora_adapters: set[str] | None = None,
        device: str | None = None,
    ) -> WorkerSlot:
        """Register a worker's capacity. ``token_budget`` is the worker's profiled budget;
        ``latency_prior`` its start-up latency curve (``slo_budget.curve_prior``), if known;
        ``lora_adapters`` the adapters it serves (``WorkerSlot.lora_adapters``; None: not reported);
        ``device`` the one it runs on as it reported it (``WorkerInfo.device``; None: in process),
        which sets its decode passes per plan unless the config does
        (``multi_pass_plan.default_decode_passes``).

        Raises ``SchedulerError`` when neither the config nor the worker gives a budget, or the name
        is taken.
        """
        budget = self.config.token_budget or token_budget
        if budget is None:
            raise SchedulerError(f"worker {name}: no token budget configured or profiled")
        if name in self.registry.slots:
            raise SchedulerError(f"worker {name} is already registered")
        account = BlockAccount(num_blocks, block_size, self.config.enable_prefix_caching)
        adapters = frozenset(lora_adapters) if lora_adapters is not None else None
        slot = WorkerSlot(name, account, budget, max_model_len, handle, adapters)
        slot.latency = PassLatency(latency_prior)
        slot.decode_passes = self.config.decode_passes or multi_pass_plan.default_decode_passes(device)
        self.registry.add(slot)
        return slot

    def remove_worker(self, name: str) -> list[Sequence]:
        """Forget a lost worker; its sequences go back to the front of the queue for recompute."""
        slot = self.registry.remove(name)
        if slot is None:
            return []
        moved = list(slot.running)
        for seq in reversed(moved):
            self.lifecycle.to_waiting(seq)
        slot.inflight.clear()
        return moved

    @property
    def max_model_len(self) -> int:
        """The shortest context window of the workers, in tokens (kept as workers come and go)."""
        return self.registry.max_model_len

    # ----- requests -----
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ``ContextLengthExceededError`` / ``InvalidRequestError``, and
        ``LoRAAdapterNotServedError`` when workers exist and none serves its adapter."""
        if seq.seq_id in self.seqs:
            raise InvalidRequestError(f"duplicate sequence id {seq.seq_id}")
        if not seq.prompt_token_ids:
            raise InvalidRequestError("empty prompt: at least one token is required", param="prompt")
        total = seq.prompt_len + seq.params.max_new_tokens
        if total > self.max_model_len:
            raise ContextLengthExceededError(seq.prompt_len, seq.params.max_new_tokens, self.max_model_len)
        slots = self.registry.slots
        if seq.lora is not None and slots and not self._lora_served(seq.lora):
            raise LoRAAdapterNotServedError(seq.lora)
        if slots:
            capacity = max(s.account.num_blocks - self.config.watermark_blocks for s in slots.values())
            block_size = next(iter(slots.values())).account.block_size
            if -(-total // block_size) > capacity:
                raise InvalidRequestError(
                    f"request needs {total} tokens of KV cache; a worker holds at most {capacity * block_size}",
                    param="max_tokens",
                )
        seq.status = SeqStatus.WAITING
        seq.arrival_time = self.clock()
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Finish a sequence now (client gone, stop string) and free its blocks. Unknown ids → None."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.lifecycle.finish(seq, reason)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(
            s.running or s.pending_free or s.inflight for s in self.slots.values()
        )

    @property
    def num_running(self) -> int:
        return sum(len(s.running) for s in self.slots.values())

    # ----- schedule -----
    def schedule(self) -> dict[str, StepPlan]:
        """The next plan of every worker with nothing in flight and something to do."""
        return self.schedule_workers([n for n, s in self.slots.items() if not s.inflight])

    def schedule_worker(self, name: str) -> StepPlan | None:
        """Build ``name``'s next plan and mark it in flight; None when the worker has nothing to do.

        Raises ``KeyError`` for an unknown worker.
        """
        return self.schedule_workers([name]).get(name)

    def schedule_workers(self, names: list[str]) -> dict[str, StepPlan]:
        """Build the next plan of each named worker together (admission picks among them) and mark
        the plans in flight (``PassBuilder.build``). Raises ``KeyError`` for an unknown worker."""
        return self.builder.build(names)

    def preempt(self, slot: WorkerSlot, seq: Sequence, draft: Draft | None = None) -> None:
        """Free a running sequence's blocks; it recomputes later from prompt + generated tokens."""
        self.builder.preempt(slot, seq, draft)

    # ----- postprocess -----
    def postprocess(self, worker: str, result: StepResult) -> list[TokenEvent]:
        """Apply the oldest plan in flight on ``worker`` (``ResultApplier.postprocess``). Raises
        ``SchedulerError`` when ``result`` does not answer that plan."""
        return self.applier.postprocess(worker, result)

    def fail_plan(self, worker: str, message: str) -> list[TokenEvent]:
        """The oldest plan in flight on ``worker`` failed: finish its sequences (``ResultApplier.fail_plan``)."""
        return self.applier.fail_plan(worker, message)

    def _lora_served(self, lora: str) -> bool:
        """Some worker serves adapter ``lora`` (``WorkerSlot.serves_lora``)."""
        return any(s.serves_lora(lora) for s in self.registry.slots.values())

    def fail_unserved_lora(self) -> list[TokenEvent]:
        """Finish the queued sequences whose LoRA adapter no worker serves (workers came or went since
        they were queued) with ``LoRAAdapterNotServedError``'s 404; none while there is no worker."""
        if not self.registry.slots:
            return []
        events = []
        for seq in [s for s in self.queue.waiting if s.lora is not None and not self._lora_served(s.lora)]:
            self.queue.waiting.remove(seq)
            self.lifecycle.finish(seq, FinishReason.ABORT)
            e = LoRAAdapterNotServedError(seq.lora)
            events.append(
                TokenEvent(
                    seq.seq_id,
                    None,
                    FinishReason.ABORT,
                    error=str(e),
                    error_status=e.http_status,
                    error_type=e.error_type,
                )
            )
        return events

    def fail_waiting(self, message: str, status: int) -> list[TokenEvent]:
        """Finish every queued sequence with an error (e.g. no worker has been alive for a while)."""
        events = []
        waiting = self.queue.waiting
        while waiting:
            seq = waiting.popleft()
            self.lifecycle.finish(seq, FinishReason.ABORT)
            events.append(
                TokenEvent(seq.seq_id, None, FinishReason.ABORT, error=message, error_status=status)
            )
        return events
