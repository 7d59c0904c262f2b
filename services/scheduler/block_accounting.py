"""Per-worker KV-block accounting in counts (the worker holds the actual block ids).

The scheduler reserves blocks here before it plans a chunk, so a worker never runs out: the
worker's allocator sees exactly the demand this account has approved.
"""

from __future__ import annotations

from fuseserve.errors import SchedulerError


class BlockAccount:
    """Free-block count of one worker and the blocks reserved per sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free = num_blocks
        self.held: dict[int, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def extra_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a sequence must add to hold ``num_tokens`` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - self.held.get(seq_id, 0))

    def can_reserve(self, seq_id: int, num_tokens: int, watermark: int = 0) -> bool:
        return self.extra_needed(seq_id, num_tokens) + watermark <= self.num_free

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's reservation to ``num_tokens`` tokens; raises ``SchedulerError`` if short."""
        extra = self.extra_needed(seq_id, num_tokens)
        if extra > self.num_free:
            raise SchedulerError(f"seq {seq_id}: needs {extra} blocks, {self.num_free} free")
        self.num_free -= extra
        self.held[seq_id] = self.held.get(seq_id, 0) + extra

    def release(self, seq_id: int) -> None:
        """Return all of a sequence's blocks (idempotent)."""
        self.num_free += self.held.pop(seq_id, 0)
