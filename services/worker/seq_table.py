"""What a worker keeps per sequence, and the plan bookkeeping every runner does (no tensors, no torch).

``SeqTable`` consumes step plans by the scheduler ↔ worker contract (``proto/worker.proto``):
``free_seq_ids`` first; a chunk with ``params`` (re)creates its sequence (a recompute restarts it
from scratch), holding ``start_pos`` tokens already (a prefix-cache hit: the K/V of its first
blocks, shared, are in the cache); every chunk starts where the worker's KV ends; a decode entry (no
token ids) feeds the token sampled last. Block ids come with the chunks: the scheduler is the one
allocator of a worker's blocks (``services/scheduler/block_accounting.py``, shared cached blocks
included), the worker only keeps and checks the tables. The model runner (``model_runner.py``) and
the simulated runner (``sim_runner.py``) both use it, so they reject plans identically.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuseserve.errors import InvalidBlockError, SchedulerError
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SeqChunk


@dataclass
class WorkerSeq:
    """What the worker keeps for one sequence.

    num_computed: tokens whose K/V are in the cache.
    last_token: token sampled last (the input of the next decode entry), None before the first sample.
    sampling: the runner's per-sequence sampling state (penalties' token history, seeded generator,
        parameters); None for a runner that keeps none.
    prompt_len: prompt tokens (penalties tell prompt from generated tokens by it).
    stopped: a multi-pass plan stopped it on a stop token (``multi_pass_run.py``); its chunks in plans
        built before the scheduler learned so are dropped until it is freed or restarted.
    lora: the LoRA adapter it runs with (its first chunk's ``lora``); None: the base model.
    """

    num_computed: int
    last_token: int | None
    sampling: Any
    prompt_len: int
    block_table: list[int]
    stopped: bool = False
    lora: str | None = None


class SeqTable:
    """Sequences of one worker with their block tables over a pool of ``num_blocks`` blocks
    (several tables may hold the same block: a shared prefix).

    new_sampling: builds a new sequence's ``WorkerSeq.sampling`` from its parameters (None: keep none).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        new_sampling: Callable[[SamplingParams], Any] | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seqs: dict[int, WorkerSeq] = {}
        self._new_sampling = new_sampling
        self._holders: collections.Counter[int] = collections.Counter()  # block id -> tables holding it

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence's table holds (cached blocks the scheduler may reuse count as free)."""
        return self.num_blocks - len(self._holders)

    def free(self, seq_ids: list[int]) -> None:
        """Drop sequences and their tables (unknown ids are ignored)."""
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self._holders.subtract(seq.block_table)
                for b in seq.block_table:
                    if self._holders[b] <= 0:
                        self._holders.pop(b, None)

    def adopt(self, seq_id: int, seq: WorkerSeq) -> None:
        """Take a sequence moved here from another worker (``kv_migration``), its table filled with
        blocks of this pool. Raises ``InvalidBlockError`` for a block id outside the pool."""
        bad = [b for b in seq.block_table if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidBlockError(f"seq {seq_id}: block ids {bad} outside [0, {self.num_blocks})")
        self.free([seq_id])
        self.seqs[seq_id] = seq
        self._holders.update(seq.block_table)

    def admit(self, c: SeqChunk) -> tuple[WorkerSeq, list[int], list[int]]:
        """Check one chunk against the sequence's state and allocate the blocks it needs.

        Returns ``(seq, input token ids [num_tokens], block table)``. Raises ``SchedulerError`` for an
        inconsistent chunk (unknown sequence, wrong start_pos, missing or extra tokens, a table too
        short for the chunk) and ``InvalidBlockError`` for a block id outside the pool; the table is
        unchanged then.
        """
        bad = [b for b in c.block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidBlockError(f"seq {c.seq_id}: block ids {bad} outside [0, {self.num_blocks})")
        seq = self._seq_for(c)
        tokens = c.token_ids if c.token_ids else self._decode_input(c, seq)
        if len(tokens) != c.num_tokens:
            raise SchedulerError(f"seq {c.seq_id}: {len(tokens)} token ids for num_tokens={c.num_tokens}")
        have = (len(seq.block_table) + len(c.block_ids)) * self.block_size
        if have < c.start_pos + c.num_tokens:
            raise SchedulerError(
                f"seq {c.seq_id}: blocks for {have} tokens, chunk ends at {c.start_pos + c.num_tokens}"
            )
        seq.block_table.extend(c.block_ids)
        self._holders.update(c.block_ids)
        return seq, tokens, seq.block_table

    def computed(self, chunks: list[SeqChunk]) -> None:
        """Record that the pass wrote the K/V of ``chunks`` (call after the pass ran)."""
        for c in chunks:
            self.seqs[c.seq_id].num_computed = c.start_pos + c.num_tokens

    def sampled(self, seq_id: int, token_id: int) -> None:
        """Record the token sampled for ``seq_id`` (the input of its next decode entry)."""
        self.seqs[seq_id].last_token = token_id

    def _seq_for(self, c: SeqChunk) -> WorkerSeq:
        seq = self.seqs.get(c.seq_id)
        if c.params is not None:
            if len(c.prefix_token_ids) != c.start_pos:
                raise SchedulerError(
                    f"seq {c.seq_id}: first chunk at {c.start_pos} with {len(c.prefix_token_ids)} prefix tokens"
                )
            if seq is not None:  # a recompute restarts the sequence from scratch
                self.free([c.seq_id])
            sampling = self._new_sampling(c.params) if self._new_sampling else None
            seq = WorkerSeq(c.start_pos, None, sampling, c.prompt_len, [], lora=c.lora)
            self.seqs[c.seq_id] = seq
        if seq is None:
            raise SchedulerError(f"seq {c.seq_id}: unknown; its first chunk must carry sampling params")
        if c.start_pos != seq.num_computed:
            raise SchedulerError(
                f"seq {c.seq_id}: chunk starts at {c.start_pos}, worker holds {seq.num_computed}"
            )
        return seq

    @staticmethod
    def _decode_input(c: SeqChunk, seq: WorkerSeq) -> list[int]:
        if seq.last_token is None or c.num_tokens != 1:
            raise SchedulerError(
                f"seq {c.seq_id}: decode entry without a sampled token (num_tokens={c.num_tokens})"
            )
        return [seq.last_token]
