"""Per-worker KV blocks by id, with automatic prefix caching: the one block allocator of fuseserve.

The scheduler is the single authority over a worker's block ids (as in vLLM v1, whose scheduler
owns the ``KVCacheManager``): it allocates them here before it plans a chunk and sends them with the
chunk (``SeqChunk.block_ids``); the worker only keeps the tables it is given
(``services/worker/seq_table.py``), so it can never run out and never disagree.

Prefix caching (``fuseserve/block_hash.py``):

- blocks are reference-counted; a full block whose K/V a worker has computed carries its hash and
  may be shared, copy-free, by every sequence whose prefix has that hash;
- a block whose last reference goes keeps its hash and stays cached; cached blocks are evicted
  least-recently-used only when a block is needed and no empty block is left;
- a partly filled block never has a hash, so it is never shared;
- the prefix index of a worker (``cached``: hash -> block) holds at most one entry per block, so
  its memory is bounded by the worker's pool;
- a block's hash is registered when the plan that fills it is built (``commit``; vLLM v1 caches
  blocks at scheduling time too): a worker runs its plans in order, so any later plan that shares
  the block reads it after it was written; a plan that fails takes its hashes back (``uncommit``);
- every method validates before it mutates; ``num_free`` (empty + cached-unreferenced blocks) is
  exact at every point: ``num_free + blocks referenced == num_blocks``.
"""

from __future__ import annotations

import collections

from fuseserve.errors import SchedulerError


class BlockAccount:
    """The blocks of one worker: ids, reference counts, block tables, and the prefix cache.

    Args:
        num_blocks / block_size: the worker's KV pool.
        prefix_caching: False keeps no hashes (every freed block is empty at once).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id (the worker's prefix index)
        self.block_hash: dict[int, int] = {}  # block id -> its hash
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        self._num_sent: dict[int, int] = {}  # seq id -> table entries already sent to the worker
        self._num_committed: dict[int, int] = {}  # seq id -> leading table entries committed or shared
        self.num_evictions = 0

    # ----- counts -----
    @property
    def num_free(self) -> int:
        """Blocks no sequence references: empty ones plus cached ones that may be evicted."""
        return len(self._empty) + len(self._evictable)

    @property
    def held(self) -> dict[int, int]:
        """Blocks in each sequence's table, by sequence id."""
        return {sid: len(t) for sid, t in self.tables.items()}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def extra_needed(self, seq_id: int, num_tokens: int, shared: list[int] = ()) -> int:
        """Free blocks a sequence takes to hold ``num_tokens`` tokens in total.

        ``shared``: cached blocks a sequence not yet holding any would start with (``match``); those
        count only when no sequence references them (they then leave the free pool).
        """
        have = len(self.tables.get(seq_id, ()))
        if have or not shared:
            return max(0, self.blocks_for(num_tokens) - have)
        revived = sum(1 for b in shared if self.ref_counts[b] == 0)
        return max(0, self.blocks_for(num_tokens) - len(shared)) + revived

    def covers(self, seq_id: int, num_tokens: int) -> bool:
        """``seq_id``'s table already holds ``num_tokens`` tokens: reserving them takes no block (the
        common decode step, checked before ``can_reserve``)."""
        table = self.tables.get(seq_id)
        return table is not None and len(table) * self.block_size >= num_tokens

    def can_reserve(self, seq_id: int, num_tokens: int, watermark: int = 0, shared: list[int] = ()) -> bool:
        return self.extra_needed(seq_id, num_tokens, shared) + watermark <= self.num_free

    # ----- prefix cache -----
    def match(self, block_hashes: list[int], max_blocks: int) -> list[int]:
        """Ids of the cached blocks holding the longest prefix of ``block_hashes`` (at most ``max_blocks``)."""
        if not self.prefix_caching:
            return []
        hit = []
        for h in block_hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def needs_commit(self, seq_id: int, num_computed: int) -> bool:
        """Whether ``num_computed`` computed tokens fill a block of ``seq_id`` not committed yet."""
        return (
            self.prefix_caching
            and seq_id in self.tables
            and (num_computed // self.block_size > self._num_committed[seq_id])
        )

    def commit(self, seq_id: int, block_hashes: list[int], num_computed: int) -> list[int]:
        """``seq_id``'s first ``num_computed`` tokens are computed by the plans sent so far: its full
        blocks get their hash. Returns the ids of the blocks hashed now.

        A hash already cached under another block (two sequences computed the same prefix at once)
        leaves this block private. Unknown sequences are ignored.
        """
        table = self.tables.get(seq_id)
        if not self.prefix_caching or table is None:
            return []
        end = min(num_computed // self.block_size, len(block_hashes), len(table))
        hashed = []
        for i in range(self._num_committed[seq_id], end):
            b, h = table[i], block_hashes[i]
            if b not in self.block_hash and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
                hashed.append(b)
        self._num_committed[seq_id] = max(end, self._num_committed[seq_id])
        return hashed

    def uncommit(self, block_ids: list[int]) -> None:
        """Take the hashes of ``block_ids`` back (the plan that was to fill them failed); a block
        nobody references goes back empty."""
        for b in block_ids:
            h = self.block_hash.pop(b, None)
            if h is None:
                continue
            del self.cached[h]
            if self.ref_counts[b] == 0:
                del self._evictable[b]
                self._empty.append(b)

    # ----- allocation -----
    def reserve(self, seq_id: int, num_tokens: int, shared: list[int] = ()) -> None:
        """Grow the sequence's table to hold ``num_tokens`` tokens, starting a new table from the
        cached blocks ``shared``. Raises ``SchedulerError`` (nothing changed) when blocks are short."""
        extra = self.extra_needed(seq_id, num_tokens, shared)
        if extra > self.num_free:
            raise SchedulerError(f"seq {seq_id}: needs {extra} blocks, {self.num_free} free")
        table = self.tables.get(seq_id)
        if table is None:
            table = self.tables[seq_id] = []
            self._num_sent[seq_id] = 0
            self._num_committed[seq_id] = len(shared)
            for b in shared:
                self._take(b)
                table.append(b)
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            b = self._empty.pop() if self._empty else self._evict()
            self._take(b)
            table.append(b)

    def unsent(self, seq_id: int) -> list[int]:
        """Block ids added to ``seq_id``'s table since the last call (they ride on its next chunk)."""
        table = self.tables.get(seq_id)
        if table is None:
            return []
        sent = self._num_sent[seq_id]
        if sent == len(table):
            return []
        self._num_sent[seq_id] = len(table)
        return table[sent:]

    def release(self, seq_id: int) -> None:
        """Drop a sequence's references (idempotent). Hashed blocks stay cached, tail blocks first in
        line for eviction so that a shared prefix outlives its suffixes."""
        table = self.tables.pop(seq_id, None)
        self._num_sent.pop(seq_id, None)
        self._num_committed.pop(seq_id, None)
        for b in reversed(table or ()):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.block_hash:
                    self._evictable[b] = None
                else:
                    self._empty.append(b)

    def _take(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            self._evictable.pop(b, None)
        self.ref_counts[b] += 1

    def _evict(self) -> int:
        b, _ = self._evictable.popitem(last=False)
        del self.cached[self.block_hash.pop(b)]
        self.num_evictions += 1
        return b

    def check(self) -> None:
        """Assert the invariants (tests): reference counts equal table references, the free count is
        exact, no referenced block is free, the index and the block hashes agree."""
        refs = collections.Counter(b for t in self.tables.values() for b in t)
        assert all(self.ref_counts[b] == refs.get(b, 0) for b in range(self.num_blocks)), "ref counts"
        free = set(self._empty) | set(self._evictable)
        assert len(free) == len(self._empty) + len(self._evictable), "a block is free twice"
        assert not free & set(refs), "a referenced block is free"
        assert self.num_free + len(refs) == self.num_blocks, "free count"
        assert all(self.cached[h] == b for b, h in self.block_hash.items()), "index"
        assert len(self.cached) == len(self.block_hash), "index"
        assert all(b in self.block_hash for b in self._evictable), "evictable without hash"


def assign_block_ids(account: BlockAccount, plan) -> None:
    """Fill ``block_ids`` of a hand-built ``StepPlan`` from ``account``, as the scheduler would (tools,
    tests and benchmarks that drive a runner directly): frees first, then each chunk's table grows to
    hold its tokens; a chunk with ``params`` starts a new table (no prefix sharing)."""
    for sid in plan.free_seq_ids:
        account.release(sid)
    for c in plan.chunks:
        if c.params is not None:
            account.release(c.seq_id)
        account.reserve(c.seq_id, c.start_pos + c.num_tokens)
        c.block_ids = account.unsent(c.seq_id)
