"""A fixed pool of KV blocks with ref counts, an LRU free queue and a prefix-cache index.

A block is *free* when no request holds it (ref count 0). A free block may still carry the hash
of the full block of tokens it holds: it stays findable in the prefix-cache index until the free
queue hands it out again, which evicts it (least recently freed first). All operations are O(1)
per block.
"""

from __future__ import annotations

from collections import OrderedDict

from platform_core.errors import PlatformCoreError


class BlockPoolError(PlatformCoreError, RuntimeError):
    """A broken invariant of the block pool (a bug, never user error)."""


class BlockPool:
    """Owns block ids ``0 .. num_blocks - 1``.

    ``allocate`` hands out blocks with ref count 1; ``touch`` adds a holder to a block found in
    the prefix cache; ``free`` drops one holder from each block and queues blocks that reach 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # Insertion order is eviction order; OrderedDict gives O(1) pop-front and removal by id.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the tokens of ``block_hash``, if cached."""
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the free queue, evicting their cached hashes."""
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Add a holder to each block (a prefix-cache hit), pulling free ones off the queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; blocks reaching 0 join the back of the free queue.

        Pass blocks in the order they should be evicted (callers free a request's tail first,
        so shared prefixes outlive the suffixes that depend on them).
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise BlockPoolError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count
            if count == 0:
                if self.block_hashes[block_id] is None:
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block under its hash so later requests can share it."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds these tokens; keep the first
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is held."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]

    def check_integrity(self) -> None:
        """Raise ``BlockPoolError`` if any invariant is broken."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a block is queued twice")
        for block_id, count in enumerate(self.ref_counts):
            if count < 0:
                raise BlockPoolError(f"block {block_id} has ref count {count}")
            if (count == 0) != (block_id in free):
                raise BlockPoolError(
                    f"block {block_id} has ref count {count} but is "
                    f"{'in' if block_id in free else 'not in'} the free queue"
                )
        used = sum(1 for c in self.ref_counts if c > 0)
        if used + len(free) != self.num_blocks:
            raise BlockPoolError(f"free {len(free)} + used {used} != total {self.num_blocks}")
        for block_hash, block_id in self._cached.items():
            if self.block_hashes[block_id] != block_hash:
                raise BlockPoolError(f"cache index points at block {block_id} with another hash")
