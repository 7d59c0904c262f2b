"""KV-cache blocks by id: a block allocator and per-sequence block tables (no tensors, no torch).

The tensors the ids index are in ``kv_cache.py``; keeping the accounting apart lets a simulated
worker (``sim_runner.py``) account blocks with the very same code as the model runner.
"""

from __future__ import annotations

from fuseserve.errors import DoubleFreeError, InvalidBlockError, KVCacheFullError


class BlockAllocator:
    """Free list of block ids ``0..num_blocks-1``. Every method validates before it mutates."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._allocated = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks currently free."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks. Raises ``KVCacheFullError`` (nothing taken) when fewer are free."""
        if n > len(self._free):
            raise KVCacheFullError(n, len(self._free))
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._allocated[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Return blocks. Raises ``InvalidBlockError`` / ``DoubleFreeError`` (nothing freed) on a bad id."""
        seen: set[int] = set()
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise InvalidBlockError(f"block id {b} outside [0, {self.num_blocks})")
            if not self._allocated[b] or b in seen:
                raise DoubleFreeError(f"block {b} is not allocated")
            seen.add(b)
        for b in block_ids:
            self._allocated[b] = 0
            self._free.append(b)


class BlockTables:
    """Block table per sequence id, growing on demand from a ``BlockAllocator``."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks a sequence needs to hold ``num_tokens`` tokens in total."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the table.

        Raises ``KVCacheFullError`` (table unchanged) when the blocks are not free.
        """
        need = self.blocks_needed(seq_id, num_tokens)
        table = self.tables.setdefault(seq_id, [])
        if need:
            table.extend(self.allocator.allocate(need))
        return table

    def free(self, seq_id: int) -> None:
        """Release all of a sequence's blocks (unknown ids are ignored: freeing is idempotent)."""
        table = self.tables.pop(seq_id, None)
        if table:
            self.allocator.free(table)
