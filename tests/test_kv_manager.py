"""KV manager: slot allocation as sequences grow, prefix hashing and sharing, freeing."""

from dataclasses import dataclass

from platform_core.kv_cache.hashing import extend_block_hashes, hash_block
from platform_core.kv_cache.manager import KVCacheManager
from platform_core.lora_request import LoRARequest


@dataclass
class Sequence:
    """A token sequence as the manager sees one: no scheduler involved."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    lora_request: LoRARequest | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id, list(tokens), salt)


def test_chained_hash_depends_on_whole_prefix():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6], 2)
    extend_block_hashes(b, [9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parents
    assert hash_block(a[0], [3, 4]) == a[1]


def test_allocation_grows_by_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("r", list(range(10)))
    assert kv.allocate_slots(req, 10)
    assert len(kv.block_ids("r")) == 3
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2)  # 12 tokens: still 3 blocks
    assert len(kv.block_ids("r")) == 3
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids("r")) == 4
    kv.check_integrity()
    kv.free(req.request_id)
    assert kv.pool.num_free_blocks == 10


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("r", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.block_ids("r") == [] and kv.pool.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_is_shared_and_last_token_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_blocks(first)

    same = make_request("b", list(range(8)))
    hits = kv.find_cached_prefix(same)
    assert hits == kv.block_ids("a")[:1]  # 8 tokens: at most 7 may come from the cache
    longer = make_request("c", list(range(8)) + [99])
    hits = kv.find_cached_prefix(longer)
    assert hits == kv.block_ids("a")
    assert kv.allocate_slots(longer, 1, hits)
    assert kv.block_ids("c")[:2] == kv.block_ids("a")
    assert kv.pool.ref_counts[hits[0]] == 2
    kv.check_integrity()
    kv.free(first.request_id)
    kv.free(longer.request_id)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 10


def test_freed_blocks_stay_cached_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.free(a.request_id)
    again = make_request("a2", [1, 2, 3, 4, 5])
    assert len(kv.find_cached_prefix(again)) == 2


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5], salt="alice")
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5], salt="bob")) == []
    assert len(kv.find_cached_prefix(make_request("c", [1, 2, 3, 4, 5], salt="alice"))) == 2


def test_adapters_share_no_blocks_with_each_other_or_the_base_model():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    first, second = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")
    a = make_request("a", tokens)
    a.lora_request = first
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    base = make_request("base", tokens)
    other = make_request("other", tokens)
    other.lora_request = second
    same = make_request("same", tokens)
    same.lora_request = first
    assert kv.find_cached_prefix(base) == []
    assert kv.find_cached_prefix(other) == []
    assert len(kv.find_cached_prefix(same)) == 2
    # A salt that spells an adapter's key is not that adapter.
    assert kv.find_cached_prefix(make_request("salted", tokens, salt=first.cache_key)) == []
    kv.check_integrity()


def test_claiming_free_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.free(a.request_id)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    # 8 tokens need 4 blocks: 2 cached + 2 new, but only 1 block is free beyond the cached ones.
    assert not kv.allocate_slots(b, 4, hits)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 3


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    assert not kv.reset_prefix_cache()  # blocks are held
    kv.free(a.request_id)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []
    kv.check_integrity()


def test_stats_report_blocks_and_the_lookups_recorded():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    kv.record_prefix_lookup(5, 0)
    kv.record_prefix_lookup(7, 4)
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_free_blocks) == (6, 3, 3)
    assert stats.block_size == 2
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (12, 4)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    parent = make_request("p", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    copies = kv.fork(parent, "p#1")
    parent_blocks, child_blocks = kv.block_ids("p"), kv.block_ids("p#1")
    assert child_blocks[:2] == parent_blocks[:2]
    assert copies == [(parent_blocks[2], child_blocks[2])]
    assert child_blocks[2] not in parent_blocks
    kv.check_integrity()
    kv.free("p#1")
    kv.free("p")
    assert kv.stats().num_free_blocks == 6


def test_host_kv_tensors_read_as_zeros_and_are_writable():
    import torch

    from platform_core.worker.kv_tensors import zeroed_host_tensor

    cache = zeroed_host_tensor((2, 64, 4, 16, 8), torch.bfloat16)
    assert cache.shape == (2, 64, 4, 16, 8) and cache.is_contiguous()
    assert cache.count_nonzero() == 0
    cache[1, 63, 3, 15, 7] = 2.5
    cache[0, 0, 0, 0, 0] = -1.0
    assert cache.count_nonzero() == 2 and cache.float().sum() == 1.5
    assert zeroed_host_tensor((0, 4), torch.float32).shape == (0, 4)
