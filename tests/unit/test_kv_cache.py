"""Paged KV cache: the scheduler's block allocator (ids, reference counts, prefix cache) validates
before it mutates and keeps an exact free count; the worker's KV tensors are sized from memory."""

from __future__ import annotations

import pytest
import torch

from fuseserve.block_hash import extend_block_hashes, hash_block, root_hash
from fuseserve.errors import KVCacheTooSmallError, SchedulerError
from fuseserve.scheduler.block_accounting import BlockAccount
from fuseserve.worker.kv_cache import KVCache, bytes_per_block


@pytest.fixture
def account():
    a = BlockAccount(10, block_size=4)
    yield a
    a.check()  # nothing lost or invented


def test_reserve_to_exhaustion_then_typed_error_and_nothing_taken(account):
    account.reserve(1, 16)
    account.reserve(2, 20)
    assert sorted(account.tables[1] + account.tables[2]) == list(range(9)) and account.num_free == 1
    with pytest.raises(SchedulerError):
        account.reserve(3, 8)  # two blocks, one free: nothing taken
    assert account.num_free == 1 and 3 not in account.tables
    account.release(1)
    account.release(1)  # idempotent
    assert account.num_free == 5


def test_tables_grow_by_need_and_unsent_hands_out_each_block_once(account):
    account.reserve(1, 9)
    assert len(account.tables[1]) == 3 and account.unsent(1) == account.tables[1]
    account.reserve(1, 12)  # still 3 blocks
    assert account.unsent(1) == []
    account.reserve(1, 13)
    assert account.unsent(1) == account.tables[1][3:]


def hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    return extend_block_hashes([], tokens, len(tokens), 4, root_hash("m", salt))


def test_block_hash_chains_parent_model_and_salt():
    a = hashes(list(range(12)))
    assert a == hashes(list(range(12))) and len(a) == 3  # deterministic, full blocks only
    assert hashes(list(range(13))) == a  # a partial last block has no hash
    b = hashes([99, *range(1, 12)])  # only the first block differs: every later hash differs too
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert hashes(list(range(12)), salt="tenant-b")[0] != a[0]
    assert extend_block_hashes([], list(range(4)), 4, 4, root_hash("other-model"))[0] != a[0]
    assert hash_block(a[0], range(4, 8)) == a[1]


def test_shared_prefix_is_reference_counted_and_stays_cached(account):
    h = hashes(list(range(12)))
    account.reserve(1, 12)
    assert account.match(h, 3) == []  # nothing committed yet: the pass has not run
    account.commit(1, h, 12)
    shared = account.match(h, 2)
    assert shared == account.tables[1][:2]
    free = account.num_free
    assert account.extra_needed(2, 10, shared) == 1  # blocks 0-1 shared, one new block
    account.reserve(2, 10, shared)
    assert account.num_free == free - 1 and account.ref_counts[shared[0]] == 2
    account.release(1)
    assert account.ref_counts[shared[0]] == 1 and account.num_free == free - 1 + 1  # block 2: cached, free
    account.release(2)
    assert account.num_free == 10 and account.match(h, 3) != []  # all free, the prefix still cached


def test_cached_blocks_evicted_lru_only_when_needed(account):
    h = hashes(list(range(16)))
    account.reserve(1, 16)
    account.commit(1, h, 16)
    account.release(1)
    assert len(account.cached) == 4 and account.num_free == 10
    account.reserve(2, 24)  # six empty blocks are used first: the cache survives
    assert len(account.match(h, 4)) == 4 and account.num_evictions == 0
    account.reserve(3, 4)  # one more: evicts the least recently used, the prefix's tail block
    assert account.num_evictions == 1 and len(account.match(h, 4)) == 3
    revived = account.match(h, 3)
    assert account.extra_needed(4, 12, revived) == 3  # reviving cached blocks takes them off the free list
    account.reserve(4, 12, revived)
    with pytest.raises(SchedulerError):
        account.reserve(5, 4)  # the referenced cached blocks are never evicted
    for sid in (2, 3, 4):
        account.release(sid)


def test_same_prefix_computed_twice_keeps_one_cached_copy(account):
    h = hashes(list(range(8)))
    account.reserve(1, 8)
    account.reserve(2, 8)
    account.commit(1, h, 8)
    account.commit(2, h, 8)  # the duplicate stays private and goes back empty when released
    assert account.match(h, 2) == account.tables[1]
    account.release(2)
    account.release(1)
    assert len(account.cached) == 2


def test_prefix_caching_off_keeps_no_hashes():
    a = BlockAccount(4, 4, prefix_caching=False)
    h = hashes(list(range(8)))
    a.reserve(1, 8)
    a.commit(1, h, 8)
    a.release(1)
    assert a.cached == {} and a.match(h, 2) == [] and a.num_free == 4
    a.check()


def test_kv_cache_shapes_and_sizing():
    per_block = bytes_per_block(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert per_block == 2 * 2 * 16 * 3 * 64 * 4
    n = KVCache.num_blocks_for(10 * per_block + 5, 2, 16, 3, 64, torch.float32)
    assert n == 10
    cache = KVCache(2, n, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert cache.k[0].shape == (10, 16, 3, 64) and len(cache.v) == 2
    with pytest.raises(KVCacheTooSmallError):
        KVCache(2, 0, 16, 3, 64, torch.float32, torch.device("cpu"))


def test_sequence_hashes_each_block_once_across_prompt_and_output():
    """``Sequence.full_block_hashes`` extends its hashes as tokens arrive; they equal the hashes of the
    whole token list, blocks straddling the prompt and the generated tokens included."""
    from fuseserve.sampling_params import SamplingParams
    from fuseserve.scheduler.sequence import Sequence

    seq = Sequence(1, list(range(10)), SamplingParams())
    root = root_hash("m")
    assert seq.full_block_hashes(4, root) == hashes(list(range(10)))[:2]
    for t in range(10, 23):
        seq.output_token_ids.append(t)
        assert seq.full_block_hashes(4, root) == hashes(list(range(t + 1)))
    assert seq.token_slice(8, 13) == [8, 9, 10, 11, 12] and seq.token_slice(11, 14) == [11, 12, 13]


def test_covers_means_reserving_takes_nothing(account):
    assert not account.covers(1, 1)  # no table yet
    account.reserve(1, 5)
    assert account.covers(1, 8) and not account.covers(1, 9)
