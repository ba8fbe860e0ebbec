"""Chained block hashes for automatic prefix caching.

The hash of block ``i`` covers the hash of block ``i - 1``, the block's token ids and any extra
keys (a cache salt, an adapter id), so equal hashes mean equal whole prefixes. SHA-256 keeps
collisions out of reach even when tenants choose their prompts adversarially.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Hash of one full block given its parent's hash."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\x00" + key.encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] = (),
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``.

    Extra keys enter the first block's hash only; the chain carries them to every later block.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, block, extra_keys if i == 0 else ()))
