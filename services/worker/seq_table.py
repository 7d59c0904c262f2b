"""What a worker keeps per sequence, and the plan bookkeeping every runner does (no tensors, no torch).

``SeqTable`` consumes step plans by the scheduler ↔ worker contract (``proto/worker.proto``):
``free_seq_ids`` first; a chunk with ``start_pos == 0`` and ``params`` (re)creates its sequence (a
recompute restarts it from scratch); every chunk starts where the worker's KV ends; a decode entry
(no token ids) feeds the token sampled last; blocks are allocated as chunks need them. The model
runner (``model_runner.py``) and the simulated runner (``sim_runner.py``) both use it, so they
account blocks and reject plans identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuseserve.errors import SchedulerError
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SeqChunk
from fuseserve.worker.blocks import BlockAllocator, BlockTables


@dataclass
class WorkerSeq:
    """What the worker keeps for one sequence.

    num_computed: tokens whose K/V are in the cache.
    last_token: token sampled last (the input of the next decode entry), None before the first sample.
    sampling: the runner's per-sequence sampling state (penalties' token history, seeded generator,
        parameters); None for a runner that keeps none.
    prompt_len: prompt tokens (penalties tell prompt from generated tokens by it).
    """

    num_computed: int
    last_token: int | None
    sampling: Any
    prompt_len: int


class SeqTable:
    """Sequences of one worker with their block tables over a pool of ``num_blocks`` blocks.

    new_sampling: builds a new sequence's ``WorkerSeq.sampling`` from its parameters (None: keep none).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        new_sampling: Callable[[SamplingParams], Any] | None = None,
    ):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables = BlockTables(self.allocator, block_size)
        self.seqs: dict[int, WorkerSeq] = {}
        self._new_sampling = new_sampling

    @property
    def num_free_blocks(self) -> int:
        """Blocks currently free."""
        return self.allocator.num_free_blocks

    def free(self, seq_ids: list[int]) -> None:
        """Drop sequences and return their blocks (unknown ids are ignored)."""
        for sid in seq_ids:
            self.seqs.pop(sid, None)
            self.block_tables.free(sid)

    def admit(self, c: SeqChunk) -> tuple[WorkerSeq, list[int], list[int]]:
        """Check one chunk against the sequence's state and allocate the blocks it needs.

        Returns ``(seq, input token ids [num_tokens], block table)``. Raises ``SchedulerError`` for an
        inconsistent chunk (unknown sequence, wrong start_pos, missing or extra tokens) and
        ``KVCacheFullError`` (table unchanged) when blocks run out; the scheduler's accounting
        prevents both.
        """
        seq = self._seq_for(c)
        tokens = c.token_ids if c.token_ids else self._decode_input(c, seq)
        if len(tokens) != c.num_tokens:
            raise SchedulerError(f"seq {c.seq_id}: {len(tokens)} token ids for num_tokens={c.num_tokens}")
        table = self.block_tables.ensure(c.seq_id, c.start_pos + c.num_tokens)
        return seq, tokens, table

    def computed(self, chunks: list[SeqChunk]) -> None:
        """Record that the pass wrote the K/V of ``chunks`` (call after the pass ran)."""
        for c in chunks:
            self.seqs[c.seq_id].num_computed = c.start_pos + c.num_tokens

    def sampled(self, seq_id: int, token_id: int) -> None:
        """Record the token sampled for ``seq_id`` (the input of its next decode entry)."""
        self.seqs[seq_id].last_token = token_id

    def _seq_for(self, c: SeqChunk) -> WorkerSeq:
        seq = self.seqs.get(c.seq_id)
        if c.start_pos == 0 and c.params is not None:
            if seq is not None:  # a recompute restarts the sequence from scratch
                self.free([c.seq_id])
            sampling = self._new_sampling(c.params) if self._new_sampling else None
            seq = WorkerSeq(0, None, sampling, c.prompt_len)
            self.seqs[c.seq_id] = seq
        if seq is None:
            raise SchedulerError(f"seq {c.seq_id}: first chunk must have start_pos=0 and sampling params")
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
