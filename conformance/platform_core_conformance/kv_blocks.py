"""KV blocks in the canonical layout, for the block-transfer checks.

KV connectors move whole blocks as ``[2, n, block_size, num_kv_heads, head_size]`` (0 keys,
1 values, tokens in order), whatever the backend's own cache layout; a backend exports and
imports them through ``AttentionOps.export_blocks`` / ``import_blocks``. The expected blocks
come from the reference: the same tokens written into a canonical cache by
``reference_write_kv``, read back by ``reference_export_blocks``.
"""

from __future__ import annotations

import torch

from platform_core.backend_api import (
    AttentionOps,
    reference_export_blocks,
    reference_kv_cache_shape,
    reference_write_kv,
)
from platform_core_conformance.batches import AttentionCase, AttentionShape, write_step

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_cache(shape: AttentionShape, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host cache in the canonical layout."""
    dims = reference_kv_cache_shape(
        num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size
    )
    return torch.zeros(dims, dtype=dtype)


def backend_cache(
    ops: AttentionOps, shape: AttentionShape, num_blocks: int, device: torch.device
) -> torch.Tensor:
    """A zeroed cache in the backend's layout."""
    dims = ops.kv_cache_shape(num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size)
    return torch.zeros(dims, dtype=shape.torch_dtype, device=device)


def random_tokens(shape: AttentionShape, count: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random keys and values ``[count, num_kv_heads, head_size]`` in the shape's dtype."""
    gen = torch.Generator().manual_seed(seed)
    dims = (count, shape.num_kv_heads, shape.head_size)
    return tuple(torch.randn(dims, generator=gen).to(shape.torch_dtype) for _ in range(2))


def written_caches(
    ops: AttentionOps,
    shape: AttentionShape,
    num_blocks: int,
    slots: list[int],
    device: torch.device,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A backend cache and a canonical host cache, zeros but for the same random K/V at
    ``slots``: written by the backend's ``write_kv`` (with ``-1`` padding rows) and by the
    reference."""
    keys, values = random_tokens(shape, len(slots), seed)
    cache = backend_cache(ops, shape, num_blocks, device)
    write_step(ops, cache, keys, values, slots)
    reference = reference_cache(shape, num_blocks, shape.torch_dtype)
    reference_write_kv(keys, values, reference, torch.tensor(slots, dtype=torch.int64))
    return cache, reference


def case_blocks(case: AttentionCase) -> tuple[list[int], torch.Tensor]:
    """Every block of the case's tables and its canonical content (host, the case's dtype):
    each sequence's rounded K/V in token order, zeros past its end."""
    shape = case.shape
    cache = reference_cache(shape, case.num_blocks, shape.torch_dtype)
    for i, seq in enumerate(case.seqs):
        slots = torch.tensor(case.slots(i, 0, seq.total), dtype=torch.int64)
        reference_write_kv(case.keys[i], case.values[i], cache, slots)
    ids = [block for table in case.tables for block in table]
    return ids, reference_export_blocks(cache, torch.tensor(ids))


def exported(
    ops: AttentionOps, cache: torch.Tensor, block_ids: list[int], shape: AttentionShape
) -> torch.Tensor:
    """``ops.export_blocks`` of ``block_ids``, on the host; fails unless it returned a new
    tensor of the canonical shape in the cache's dtype and device, leaving the cache as it was."""
    before = cache.clone()
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    blocks = ops.export_blocks(cache, ids, block_size=shape.block_size, head_size=shape.head_size)
    want = (2, len(block_ids), shape.block_size, shape.num_kv_heads, shape.head_size)
    assert tuple(blocks.shape) == want, f"export_blocks returned {tuple(blocks.shape)}, not {want}"
    assert blocks.dtype == cache.dtype, f"export_blocks returned {blocks.dtype}, not {cache.dtype}"
    assert blocks.device == cache.device, f"export_blocks returned blocks on {blocks.device}"
    assert torch.equal(cache, before), "export_blocks must not modify the KV cache"
    shared = blocks.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert not (shared and blocks.numel()), "export_blocks must return a new tensor, not a view"
    return blocks.cpu()


def imported(
    ops: AttentionOps, cache: torch.Tensor, block_ids: list[int], blocks: torch.Tensor
) -> None:
    """``ops.import_blocks`` of ``blocks`` at ``block_ids`` (ids on the cache's device)."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    ops.import_blocks(cache, ids, blocks)


def assert_blocks_equal(
    actual: torch.Tensor, expected: torch.Tensor, block_ids: list[int], label: str
) -> None:
    """Bitwise equality of canonical blocks; a failure names the first differing element
    (keys or values, block id, token, kv head, dim) with both values."""
    assert actual.dtype == expected.dtype, f"{label}: dtype {actual.dtype} != {expected.dtype}"
    bits = _BITS[actual.element_size()]
    differ = (actual.view(bits) != expected.view(bits)).nonzero()
    if not len(differ):
        return
    kv, i, token, head, dim = differ[0].tolist()
    raise AssertionError(
        f"{label}: {len(differ)} elements differ, the first in the "
        f"{('keys', 'values')[kv]} of block {block_ids[i]} (position {i}), token {token}, kv "
        f"head {head}, dim {dim}: backend {actual[kv, i, token, head, dim].item()} vs expected "
        f"{expected[kv, i, token, head, dim].item()}"
    )
