"""Block pool: allocation, ref counts, LRU eviction of cached blocks, integrity checks."""

import pytest

from platform_core.kv_cache.block_pool import BlockPool, BlockPoolError


def test_allocate_and_free_keep_counts():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    pool.check_integrity()
    pool.free(blocks)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_detected():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(BlockPoolError):
        pool.free([block])


def test_cached_block_is_found_until_evicted_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.free([a])  # freed first: evicted first
    pool.free([b])
    pool.free([c])  # uncached: goes to the front and is reused before cached ones
    assert pool.lookup(b"A") == a and pool.lookup(b"B") == b
    assert pool.allocate(1) == [c]
    assert pool.lookup(b"A") == a
    assert pool.allocate(1) == [a]
    assert pool.lookup(b"A") is None  # evicted when handed out again
    assert pool.lookup(b"B") == b
    pool.check_integrity()


def test_touch_takes_a_free_cached_block_off_the_queue():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.cache_block(a, b"A")
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert pool.ref_counts[a] == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert pool.ref_counts[a] == 2
    pool.free([a, a])
    pool.check_integrity()
    assert pool.num_free_blocks == 2


def test_integrity_check_catches_corruption():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_counts[3] = 1  # held but still queued as free
    with pytest.raises(BlockPoolError):
        pool.check_integrity()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache_block(a, b"A")
    assert pool.lookup(b"A") is None
