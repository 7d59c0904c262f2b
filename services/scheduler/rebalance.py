"""Rebalancing by KV migration (``--migration balance``): which sequences move, from where to where.

Each sequence's expected finish on its worker comes from ``placement.finish_times`` (the worker's
measured pass times, the prompt tokens still to compute, the tokens each sequence may still
generate, the batch shrinking as sequences end); a worker's queue delay is its last finish. When the
longest queue delay exceeds the shortest by ``balance_threshold`` seconds, sequences move from the
first worker to the second, those with the most tokens left to generate first (the ones its clients
would wait for longest), each only when the move lowers the sum of the two workers' finish times
(what the clients wait in all): not onto a worker where it, or those already there, would finish
later than they gain. A sequence that asked for prompt logprobs, or does not fit the destination
(blocks for all its tokens above the watermark, ``max_num_seqs``, the adapter slots), stays.

A worker with no measured pass yet (one that just joined) is estimated with another's line; when
that shows no gain it still gets one sequence, the longest to run, whose passes then measure it (a
3x-faster worker that joined idle would otherwise look as slow as the others and stay idle).

The moves are carried out by ``migration.Migrations`` like a drain's: the source gets no plan until
its plans in flight are answered, then sends the K/V.

The plan is made at most every ``BALANCE_INTERVAL_S`` seconds, never for a worker already moving
sequences or draining, and only between workers whose handles migrate.
"""

from __future__ import annotations

from fuseserve.config import EngineConfig
from fuseserve.scheduler.placement import StepTimeModel, finish_times
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.worker_slot import MigrationPhase, WorkerSlot

BALANCE_INTERVAL_S = 0.5  # between two rebalancing decisions of one scheduler


def outputs_left(seq: Sequence, max_model_len: int) -> int:
    """Tokens ``seq`` may still generate: its ``max_tokens`` less those generated, within the context."""
    left = seq.params.max_new_tokens - len(seq.output_token_ids)
    return max(0, min(left, max_model_len - seq.num_tokens))


class Load:
    """What a worker holds, as ``finish_times`` reads it; sequences can be taken out and put in."""

    def __init__(self, slot: WorkerSlot, fallback: StepTimeModel | None):
        self.slot = slot
        self.fallback = fallback
        self.prompt = sum(s.num_uncomputed for s in slot.running if s.in_prefill)
        self.outputs = [outputs_left(s, slot.max_model_len) for s in slot.running]
        self.blocks = 0  # blocks promised to sequences moving here in this plan
        self.adapters: set[str] = set()  # LoRA adapters of the sequences moving here in this plan

    def finishes(self) -> list[float]:
        """Each sequence's expected finish, seconds from now, in increasing order."""
        s = self.slot
        return finish_times(s.step_time, self.fallback, s.token_budget, self.prompt, self.outputs)

    def delay(self) -> float:
        """The queue delay: seconds until its last sequence finishes (0.0 with none)."""
        return max(self.finishes(), default=0.0)

    def moved(self, seq: Sequence, sign: int) -> None:
        """Take ``seq`` out (``sign`` -1) or put it in (+1)."""
        self.prompt += sign * (seq.num_uncomputed if seq.in_prefill else 0)
        left = outputs_left(seq, self.slot.max_model_len)
        if sign > 0:
            self.outputs.append(left)
        else:
            self.outputs.remove(left)


def plan_rebalance(config: EngineConfig, slots: list[WorkerSlot]) -> tuple[WorkerSlot, dict[int, str]] | None:
    """The source worker and its moves (sequence id -> destination worker), or None when the queue
    delays are within ``config.balance_threshold`` or no move would lower the finish times' sum.
    ``slots``: the workers that may take part (not draining, handle migrates, no round under way)."""
    if len(slots) < 2:
        return None
    measured = [s.step_time for s in slots if s.step_time.seconds(1) is not None]
    fallback = measured[0] if measured else None
    loads = {s.name: Load(s, fallback) for s in slots}
    delay = {name: load.delay() for name, load in loads.items()}
    src = loads[max(delay, key=delay.get)]
    dst = loads[min(delay, key=delay.get)]
    if delay[src.slot.name] - delay[dst.slot.name] <= config.balance_threshold:
        return None
    waited = sum(src.finishes()) + sum(dst.finishes())
    moves: dict[int, str] = {}
    room = config.max_num_seqs - len(dst.slot.running)
    by_left = sorted(src.slot.running, key=lambda s: -outputs_left(s, src.slot.max_model_len))
    for seq in by_left:
        if len(moves) >= room:
            break
        if seq.params.prompt_logprobs is not None or not _fits(config, dst, seq):
            continue
        src.moved(seq, -1)
        dst.moved(seq, +1)
        now = sum(src.finishes()) + sum(dst.finishes())
        if now < waited - 1e-9:
            waited = now
            moves[seq.seq_id] = dst.slot.name
            dst.blocks += dst.slot.account.blocks_for(seq.num_tokens)
            if seq.lora is not None:
                dst.adapters.add(seq.lora)
        else:  # no gain: put it back
            src.moved(seq, +1)
            dst.moved(seq, -1)
    if not moves and dst.slot.step_time.seconds(1) is None:  # a worker never measured (one that joined):
        probe = next((q for q in by_left if q.params.prompt_logprobs is None and _fits(config, dst, q)), None)
        if probe is not None and room > 0:  # one sequence teaches the scheduler its speed
            moves[probe.seq_id] = dst.slot.name
    return (src.slot, moves) if moves else None


def _fits(config: EngineConfig, dst: Load, seq: Sequence) -> bool:
    """Blocks for all of ``seq``'s tokens fit ``dst`` beside the moves planned there, above the watermark,
    and its LoRA adapter may run there (served, and a free adapter slot or one already holding it)."""
    account = dst.slot.account
    need = account.blocks_for(seq.num_tokens)
    if account.num_free - dst.blocks - need < config.watermark_blocks:
        return False
    return dst.slot.lora_fits(seq, config.max_loras, dst.adapters)


def balances(config: EngineConfig, slot: WorkerSlot) -> bool:
    """``slot`` may take part in rebalancing now: balance is on, it is not draining, its handle
    migrates, and it has no round of moves planned or under way."""
    return (
        config.migration == "balance"
        and not slot.draining
        and hasattr(slot.handle, "migrate")
        and slot.migration is MigrationPhase.NONE
        and not slot.balance
    )
