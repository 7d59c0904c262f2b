"""Paged KV cache: the block allocator and block tables validate before they mutate."""

from __future__ import annotations

import pytest
import torch

from fuseserve.errors import DoubleFreeError, InvalidBlockError, KVCacheFullError, KVCacheTooSmallError
from fuseserve.worker.blocks import BlockAllocator, BlockTables
from fuseserve.worker.kv_cache import KVCache, bytes_per_block


@pytest.fixture
def allocator():
    a = BlockAllocator(10)
    yield a
    assert a.num_free_blocks + sum(a._allocated) == a.num_blocks  # nothing lost or invented


def test_allocate_to_exhaustion_then_typed_error(allocator):
    got = allocator.allocate(4) + allocator.allocate(6)
    assert sorted(got) == list(range(10)) and allocator.num_free_blocks == 0
    with pytest.raises(KVCacheFullError) as e:
        allocator.allocate(1)
    assert (e.value.requested, e.value.free) == (1, 0)
    allocator.free(got)
    assert allocator.num_free_blocks == 10


def test_failed_allocation_takes_nothing(allocator):
    allocator.allocate(8)
    with pytest.raises(KVCacheFullError):
        allocator.allocate(3)
    assert allocator.num_free_blocks == 2


def test_double_free_rejected_and_nothing_freed(allocator):
    blocks = allocator.allocate(3)
    allocator.free(blocks[:1])
    with pytest.raises(DoubleFreeError):
        allocator.free(blocks)  # blocks[0] is already free: the others must stay allocated
    assert allocator.num_free_blocks == 8
    with pytest.raises(DoubleFreeError):
        allocator.free([blocks[1], blocks[1]])  # the same id twice in one call
    assert allocator.num_free_blocks == 8
    allocator.free(blocks[1:])
    assert allocator.num_free_blocks == 10


def test_out_of_range_block_rejected(allocator):
    with pytest.raises(InvalidBlockError):
        allocator.free([10])
    with pytest.raises(InvalidBlockError):
        allocator.free([-1])
    assert allocator.num_free_blocks == 10


def test_block_tables_grow_by_need_and_free_everything():
    a = BlockAllocator(8)
    tables = BlockTables(a, block_size=4)
    assert tables.blocks_needed(1, 9) == 3
    t = tables.ensure(1, 9)
    assert len(t) == 3 and tables.ensure(1, 12) == t  # 12 tokens still fit in 3 blocks
    assert len(tables.ensure(1, 13)) == 4
    tables.ensure(2, 16)
    with pytest.raises(KVCacheFullError):
        tables.ensure(3, 1)
    assert 3 not in tables.tables or tables.tables[3] == []
    tables.free(1)
    tables.free(2)
    tables.free(2)  # idempotent
    assert a.num_free_blocks == 8


def test_kv_cache_shapes_and_sizing():
    per_block = bytes_per_block(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert per_block == 2 * 2 * 16 * 3 * 64 * 4
    n = KVCache.num_blocks_for(10 * per_block + 5, 2, 16, 3, 64, torch.float32)
    assert n == 10
    cache = KVCache(2, n, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert cache.k[0].shape == (10, 16, 3, 64) and len(cache.v) == 2
    with pytest.raises(KVCacheTooSmallError):
        KVCache(2, 0, 16, 3, 64, torch.float32, torch.device("cpu"))
