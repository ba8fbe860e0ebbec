"""Per-request block tables on top of the block pool, with automatic prefix caching.

Ownership: the manager owns each request's block list and its block hashes; requests never hold
block ids themselves. Every allocation either succeeds whole or changes nothing. The manager knows
sequences only through ``TokenSequence`` (the scheduler's ``Request`` is one) and request ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from platform_core.kv_cache.block_pool import BlockPool, BlockPoolError
from platform_core.kv_cache.hashing import extend_block_hashes
from platform_core.lora_request import LoRARequest


class TokenSequence(Protocol):
    """What the manager reads of a sequence: its id, its tokens and how many are computed."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_request(self) -> LoRARequest | None: ...


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """The pool's occupancy now and the prefix-cache lookups at admission so far (in tokens)."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


class KVCacheManager:
    """Allocates slots as sequences grow and frees them on finish, abort or preemption."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # request id -> how many of its blocks the model runner has been sent
        self._num_sent_blocks: dict[str, int] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (empty if it holds none)."""
        return self._blocks.get(request_id, [])

    def unsent_block_ids(self, request_id: str) -> tuple[int, list[int]]:
        """``(first, blocks[first:])``: the request's blocks the model runner has not been sent.

        The runner keeps a running request's block table across steps; each step sends only
        the new tail. Blocks given up by ``trim`` and replaced are sent again; after ``free``
        (finish or preemption) the whole table is.
        """
        blocks = self._blocks.get(request_id, [])
        first = self._num_sent_blocks.get(request_id, 0)
        if first == len(blocks):
            return first, []  # the common decode step: nothing new
        self._num_sent_blocks[request_id] = len(blocks)
        return first, blocks[first:]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: TokenSequence) -> list[int]:
        """Blocks already holding a prefix of the request's tokens (not yet claimed).

        At most ``num_tokens - 1`` tokens are matched: the last token must be computed so that
        the model yields logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes_of(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, request: TokenSequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens; claim ``cached_blocks`` first.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        held = self._blocks.get(request.request_id, [])
        if not cached_blocks:
            # The common decode step: the blocks held already have room.
            if len(held) * self.block_size >= request.num_computed_tokens + num_new_tokens:
                return True
            cached_blocks = []
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(held) - len(cached_blocks)
        # Cached blocks nobody holds sit in the free queue: claiming them shrinks it.
        free_cached = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if max(num_new_blocks, 0) > self.pool.num_free_blocks - free_cached:
            return False
        self.pool.touch(cached_blocks)
        blocks = self._blocks.setdefault(request.request_id, held)
        blocks.extend(cached_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        if cached_blocks:
            self._num_cached_blocks[request.request_id] = len(blocks) - max(num_new_blocks, 0)
        return True

    def fork(self, parent: TokenSequence, child_id: str) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the parent's computed KV: full blocks shared, the partial one copied.

        Returns the ``(src, dst)`` block copies to perform before the next forward pass (empty
        when the parent ends on a block boundary), or ``None``, changing nothing, when no block
        is free for the copy.
        """
        blocks = self._blocks.get(parent.request_id, [])
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return None
        shared = blocks[:num_full]
        self.pool.touch(shared)
        child_blocks = list(shared)
        copies = []
        if partial:
            [new_block] = self.pool.allocate(1)
            child_blocks.append(new_block)
            copies.append((blocks[num_full], new_block))
        self._blocks[child_id] = child_blocks
        self._num_cached_blocks[child_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_full
        )
        return copies

    def cache_computed_blocks(self, request: TokenSequence) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        if request.num_computed_tokens // self.block_size <= start:
            return  # no block completed since the last call: most decode steps
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        # Tokens computed past a stop (accepted drafts after EOS) are never published.
        computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(computed // self.block_size, len(blocks))
        if num_full <= start:
            return
        hashes = self._hashes_of(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: TokenSequence) -> None:
        """Release blocks past the request's computed tokens (after drafts are rolled back)."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(extra[::-1])
            sent = self._num_sent_blocks.get(request.request_id, 0)
            self._num_sent_blocks[request.request_id] = min(sent, keep)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._num_sent_blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])

    def forget(self, request_id: str) -> None:
        """Drop the request's hash chain once it is finished for good."""
        self._hashes.pop(request_id, None)

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup: its tokens and those found cached."""
        self._queried_tokens += num_queried_tokens
        self._hit_tokens += num_hit_tokens

    def stats(self) -> KVCacheStats:
        """Block occupancy and prefix-cache counters now."""
        pool = self.pool
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_free_blocks=pool.num_free_blocks,
            block_size=self.block_size,
            prefix_queried_tokens=self._queried_tokens,
            prefix_hit_tokens=self._hit_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while any block is held."""
        return self.pool.reset_prefix_cache()

    def blocks_completed_by(self, request: TokenSequence, num_new_tokens: int) -> list[bytes]:
        """Hashes of the full blocks that computing the request's next ``num_new_tokens`` tokens
        completes (they become prefix-cache hits once computed); empty without caching."""
        if not self.enable_prefix_caching:
            return []
        start = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        return self._hashes_of(request)[start:end] if end > start else []

    def num_blocks_in_flight(
        self, request: TokenSequence, first: int, in_flight: set[bytes]
    ) -> int:
        """How many of the request's blocks from block ``first`` on, consecutively, are among
        ``in_flight`` (blocks being computed this step), up to what a cache hit may cover."""
        hashes = self._hashes_of(request)[first : (request.num_tokens - 1) // self.block_size]
        count = 0
        for block_hash in hashes:
            if block_hash not in in_flight:
                break
            count += 1
        return count

    def _hashes_of(self, request: TokenSequence) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, _hash_keys(request))
        return hashes

    def check_integrity(self) -> None:
        """Pool invariants plus: every held block is counted once per holder."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for blocks in self._blocks.values():
            for block_id in blocks:
                holders[block_id] += 1
        if holders != self.pool.ref_counts:
            bad = [i for i, (h, r) in enumerate(zip(holders, self.pool.ref_counts)) if h != r]
            raise BlockPoolError(f"ref counts disagree with block tables at blocks {bad[:10]}")


def _hash_keys(request: TokenSequence) -> tuple[str, ...]:
    """What a sequence's blocks are keyed by besides its tokens: its cache salt (tenants share
    no blocks) and its adapter (the same tokens give other K/V under another adapter)."""
    lora = request.lora_request
    if lora is None:
        return (request.cache_salt,) if request.cache_salt else ()
    return (request.cache_salt or "", lora.cache_key)
