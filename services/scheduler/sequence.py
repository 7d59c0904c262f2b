"""A request's sequence as the scheduler sees it: token ids, counters and state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fuseserve.block_hash import hash_block
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import FinishReason  # noqa: F401 - re-exported for the scheduler


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting for recompute
    RUNNING = "running"  # admitted on a worker; KV blocks reserved there
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens (prompt + generated) and progress.

    num_computed_tokens: tokens whose K/V the worker holds or computes in a plan already sent
        (advanced when a chunk is planned; reset to 0 by a preemption).
    num_pending: tokens sampled by plans in flight whose ids are not known yet (0 or 1; with
        overlap the next plan is built while the current one runs).
    num_preemptions: times this sequence was preempted (recompute) so far.
    worker: the worker the sequence runs on while RUNNING, else None.
    admitted_at: a counter value when it was last admitted (preemption picks the largest).
    num_tokens_at_admission: tokens known when it was last admitted; only a token sampled after
        that is held by the worker as the input of a decode entry (a recompute's are not).
    cache_salt: isolates this request's prefix-cache blocks from other salts (vLLM's name); None
        shares with every request without a salt.
    lora: the LoRA adapter the request runs with (a name of the workers' ``lora_modules``); None: the
        base model. Part of its block hashes (adapters never share K/V) and of admission
        (``max_loras`` distinct adapters per worker).
    block_hashes: hashes of its full blocks so far (``fuseserve/block_hash.py``), extended as tokens
        arrive.
    num_cached_tokens: prompt tokens found in the prefix cache at its first admission (usage's
        ``cached_tokens``); num_start_tokens: tokens cached at its last admission, where its first
        chunk starts.
    arrival_time: when the scheduler queued it, on the scheduler's clock (seconds); the TTFT
        deadline counts from here (``fuseserve.scheduler.slo_budget``).

    Two sequences are equal only when they are the same object (the scheduler's lists are searched
    by identity).
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    worker: str | None = None
    admitted_at: int = -1
    num_tokens_at_admission: int = 0
    cache_salt: str | None = None
    lora: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    num_start_tokens: int = 0
    arrival_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt + generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens known or being sampled by a plan in flight: ``num_tokens + num_pending``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        """Tokens (known or pending) whose K/V are not computed nor planned (1 for a sequence in decode)."""
        return self.num_planned_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the last sampled token remain to run (prompt or recompute)."""
        return self.num_uncomputed > 1 or not (self.output_token_ids or self.num_pending)

    def ends_in_flight(self, max_model_len: int) -> bool:
        """A plan in flight samples the last token by length (``max_new_tokens`` or the context
        window ``max_model_len``): planning the sequence again would be surplus."""
        return self.num_pending > 0 and (
            len(self.output_token_ids) + self.num_pending >= self.params.max_new_tokens
            or self.num_planned_tokens >= max_model_len
        )

    def full_block_hashes(self, block_size: int, root: int) -> list[int]:
        """Hashes of every full block of the known tokens (extends ``block_hashes``: each block is
        hashed once)."""
        hashes = self.block_hashes
        for i in range(len(hashes), self.num_tokens // block_size):
            parent = hashes[i - 1] if i else root
            hashes.append(hash_block(parent, self.token_slice(i * block_size, (i + 1) * block_size)))
        return hashes

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known token ids ``start:end`` (prompt then generated), ``0 <= start``; a new list."""
        prompt = self.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return prompt[start:] + self.output_token_ids[: end - p]
