"""KV block transfer: ``export_blocks`` / ``import_blocks`` in the canonical layout.

KV connectors move whole blocks between instances that may run different backends, as
``[2, n, block_size, num_kv_heads, head_size]`` whatever the backend's own layout. Exports match
the K/V written by the backend's ``write_kv`` exactly (unwritten tokens zero); import then export
is bitwise exact and leaves the other blocks alone; attention over imported blocks matches the
reference. Over every declared dtype, block size and head size, GQA head counts, no blocks, and
blocks of another dtype held on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from platform_core.backend_api import Backend, reference_import_blocks, reference_paged_attention
from platform_core_conformance.batches import AttentionShape, Seq, make_case, run_forward
from platform_core_conformance.kv_blocks import (
    assert_blocks_equal,
    backend_cache,
    case_blocks,
    exported,
    imported,
    reference_cache,
    written_caches,
)
from platform_core_conformance.tolerances import Comparison, compare, tolerance_for

pytestmark = pytest.mark.requires("write_kv", "padding")

NUM_BLOCKS = 7
KV_HEADS = 2
EXPORTED = [5, 0, 6, 3]  # a subset, out of order, the last block included
IMPORTED = [4, 1, 6]
NUM_HEADS = 8


def _shape(dtype: str, head_size: int, block_size: int) -> AttentionShape:
    return AttentionShape(KV_HEADS, KV_HEADS, head_size, block_size, dtype)


def _some_slots(block_size: int, seed: int) -> list[int]:
    """Two thirds of the pool's slots, random: blocks full, partly written and empty."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)
    return slots[: NUM_BLOCKS * block_size * 2 // 3].tolist()


def _canonical(shape: AttentionShape, count: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random canonical blocks on the host."""
    gen = torch.Generator().manual_seed(seed)
    dims = (2, count, shape.block_size, shape.num_kv_heads, shape.head_size)
    return torch.randn(dims, generator=gen).to(dtype)


def test_kv_block_export_after_write_kv(
    backend: Backend, dtype: str, matrix_point: tuple[int, int]
) -> None:
    shape = _shape(dtype, *matrix_point)
    slots = _some_slots(shape.block_size, seed=11)
    cache, reference = written_caches(
        backend.attention, shape, NUM_BLOCKS, slots, backend.device, seed=12
    )
    blocks = exported(backend.attention, cache, EXPORTED, shape)
    expected = reference[:, EXPORTED]
    assert_blocks_equal(blocks, expected, EXPORTED, "export_blocks after write_kv")


def test_kv_block_import_export_round_trip(
    backend: Backend, dtype: str, matrix_point: tuple[int, int]
) -> None:
    shape = _shape(dtype, *matrix_point)
    every_slot = list(range(NUM_BLOCKS * shape.block_size))
    cache, _ = written_caches(
        backend.attention, shape, NUM_BLOCKS, every_slot, backend.device, seed=13
    )
    others = [block for block in range(NUM_BLOCKS) if block not in IMPORTED]
    before = exported(backend.attention, cache, others, shape)
    blocks = _canonical(shape, len(IMPORTED), seed=14, dtype=shape.torch_dtype)
    imported(backend.attention, cache, IMPORTED, blocks.to(backend.device))
    backend.synchronize()
    again = exported(backend.attention, cache, IMPORTED, shape)
    assert_blocks_equal(again, blocks, IMPORTED, "export_blocks after import_blocks")
    after = exported(backend.attention, cache, others, shape)
    assert_blocks_equal(after, before, others, "blocks not imported")


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2], ids=lambda k: f"gqa{NUM_HEADS // k}-kv{k}")
def test_kv_block_import_then_attention(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    num_kv_heads: int,
    record_error: Callable[[Comparison], None],
) -> None:
    b = base_block_size
    shape = AttentionShape(NUM_HEADS, num_kv_heads, base_head_size, b, dtype)
    case = make_case(shape, [Seq(5, 1), Seq(0, b + 1), Seq(2 * b - 1, b + 1), Seq(b, 1)], seed=15)
    ids, blocks = case_blocks(case)
    cache = backend_cache(backend.attention, shape, case.num_blocks, backend.device)
    imported(backend.attention, cache, ids, blocks.to(backend.device))
    out = run_forward(backend.attention, case, cache, backend.device)
    backend.synchronize()
    reference = reference_cache(shape, case.num_blocks, torch.float32)
    reference_import_blocks(reference, torch.tensor(ids), blocks)
    expected = reference_paged_attention(case.query.float(), reference, case.metadata, case.scale)
    comparison = compare(out, expected, tolerance_for(dtype))
    record_error(comparison)
    comparison.check(case.locate, "attention forward over imported blocks vs reference")


def test_kv_block_empty_list(
    backend: Backend, dtype: str, base_head_size: int, base_block_size: int
) -> None:
    shape = _shape(dtype, base_head_size, base_block_size)
    every_slot = list(range(NUM_BLOCKS * shape.block_size))
    cache, _ = written_caches(
        backend.attention, shape, NUM_BLOCKS, every_slot, backend.device, seed=16
    )
    exported(backend.attention, cache, [], shape)
    before = cache.clone()
    imported(backend.attention, cache, [], _canonical(shape, 0, 0, shape.torch_dtype))
    backend.synchronize()
    assert torch.equal(cache, before), "import_blocks of no blocks modified the KV cache"


def test_kv_block_import_converts_dtype_and_device(
    backend: Backend, dtype: str, base_head_size: int, base_block_size: int
) -> None:
    """Blocks of another dtype (float32, or bfloat16 for a float32 cache), on the host."""
    shape = _shape(dtype, base_head_size, base_block_size)
    other = torch.bfloat16 if shape.torch_dtype == torch.float32 else torch.float32
    cache = backend_cache(backend.attention, shape, NUM_BLOCKS, backend.device)
    blocks = _canonical(shape, len(IMPORTED), seed=17, dtype=other)
    imported(backend.attention, cache, IMPORTED, blocks)
    backend.synchronize()
    again = exported(backend.attention, cache, IMPORTED, shape)
    expected = blocks.to(shape.torch_dtype)
    assert_blocks_equal(again, expected, IMPORTED, f"import_blocks of {other} blocks")
