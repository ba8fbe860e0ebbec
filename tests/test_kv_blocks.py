"""KV blocks in the canonical layout (``AttentionOps.export_blocks`` / ``import_blocks``) across
backends: the CPU backend's tile layout and the reference layout exchange blocks exactly, both
ways, and attention over transferred blocks is identical; invalid arguments are refused, and the
defaults refuse a layout they cannot read."""

from __future__ import annotations

import pytest
import torch
from platform_core_cpu.attention import CpuAttentionOps
from platform_core_cpu.isa import host_isa

from platform_core.attention.metadata import AttentionMetadata
from platform_core.backend_api import (
    AttentionOps,
    ReferenceAttentionOps,
    UnsupportedByBackendError,
)

NUM_BLOCKS = 6
# (block_size, num_kv_heads, head_size)
GEOMETRIES = [(16, 2, 64), (8, 4, 32), (128, 1, 256), (32, 3, 48)]
MODES = ["compiled", "torch"]
DTYPES = [torch.float32, torch.bfloat16]


def _cpu_ops(mode: str) -> CpuAttentionOps:
    return CpuAttentionOps(mode, level=host_isa().level)


def _ids(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def _caches(
    ops: AttentionOps, geometry: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU-layout cache and a reference-layout cache holding the same random K/V in two thirds
    of the slots (zeros elsewhere), each written by its ops' ``write_kv``."""
    block_size, heads, head_size = geometry
    gen = torch.Generator().manual_seed(block_size * heads + head_size)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[
        : NUM_BLOCKS * block_size * 2 // 3
    ]
    keys, values = (
        torch.randn(len(slots), heads, head_size, generator=gen).to(dtype) for _ in range(2)
    )
    caches = []
    for each in (ops, ReferenceAttentionOps()):
        cache = torch.zeros(each.kv_cache_shape(NUM_BLOCKS, *geometry), dtype=dtype)
        each.write_kv(keys, values, cache, slots)
        caches.append(cache)
    return caches[0], caches[1]


def _export(ops: AttentionOps, cache: torch.Tensor, ids: torch.Tensor, geometry) -> torch.Tensor:
    block_size, _, head_size = geometry
    return ops.export_blocks(cache, ids, block_size=block_size, head_size=head_size)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "b{}-kv{}-h{}".format(*g))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_cpu_and_reference_layouts_exchange_blocks_exactly(
    mode: str, dtype: torch.dtype, geometry: tuple[int, int, int]
) -> None:
    cpu = _cpu_ops(mode)
    ref = ReferenceAttentionOps()
    cpu_cache, ref_cache = _caches(cpu, geometry, dtype)
    subset, every = _ids(4, 0, 5, 2), torch.arange(NUM_BLOCKS)
    exported = _export(cpu, cpu_cache, subset, geometry)
    assert torch.equal(exported, _export(ref, ref_cache, subset, geometry))
    assert torch.equal(exported, ref_cache[:, subset])  # the canonical layout itself

    # CPU -> reference and reference -> CPU: the caches come out identical to those written.
    into_ref = torch.zeros_like(ref_cache)
    ref.import_blocks(into_ref, every, _export(cpu, cpu_cache, every, geometry))
    assert torch.equal(into_ref, ref_cache)
    into_cpu = torch.zeros_like(cpu_cache)
    cpu.import_blocks(into_cpu, every, _export(ref, ref_cache, every, geometry))
    assert torch.equal(into_cpu, cpu_cache)


def _metadata(block_size: int) -> AttentionMetadata:
    """Two sequences over tables of out-of-order blocks: a decode and a prefill chunk."""
    tables = [[3, 0, 5], [4, 1]]
    seq_lens, query_lens = [2 * block_size + 3, block_size + 2], [1, block_size]
    starts = [0, query_lens[0], sum(query_lens)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([tables[0], [*tables[1], 0]], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # unused by forward
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_attention_over_transferred_blocks_is_identical(mode: str, dtype: torch.dtype) -> None:
    geometry = (16, 2, 64)
    cpu, ref = _cpu_ops(mode), ReferenceAttentionOps()
    cpu_cache, ref_cache = _caches(cpu, geometry, dtype)
    metadata = _metadata(geometry[0])
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(metadata.query_start_loc_cpu[-1], 8, 64, generator=gen).to(dtype)
    every, scale = torch.arange(NUM_BLOCKS), 0.125

    from_ref = torch.zeros_like(cpu_cache)
    cpu.import_blocks(from_ref, every, _export(ref, ref_cache, every, geometry))
    expected = cpu.forward(query, cpu_cache, metadata, scale)
    assert torch.equal(cpu.forward(query, from_ref, metadata, scale), expected)

    from_cpu = torch.zeros_like(ref_cache)
    ref.import_blocks(from_cpu, every, _export(cpu, cpu_cache, every, geometry))
    expected = ref.forward(query, ref_cache, metadata, scale)
    assert torch.equal(ref.forward(query, from_cpu, metadata, scale), expected)


@pytest.mark.parametrize("ops", [_cpu_ops("torch"), ReferenceAttentionOps()], ids=["cpu", "ref"])
def test_import_converts_float32_blocks_to_the_cache_dtype(ops: AttentionOps) -> None:
    geometry = (16, 2, 64)
    cache = torch.zeros(ops.kv_cache_shape(NUM_BLOCKS, *geometry), dtype=torch.bfloat16)
    blocks = torch.randn(2, 2, *geometry, generator=torch.Generator().manual_seed(2))
    ops.import_blocks(cache, _ids(5, 1), blocks)
    assert torch.equal(_export(ops, cache, _ids(5, 1), geometry), blocks.to(torch.bfloat16))
    assert not _export(ops, cache, _ids(0, 2, 3, 4), geometry).any()


@pytest.mark.parametrize("ops", [_cpu_ops("torch"), ReferenceAttentionOps()], ids=["cpu", "ref"])
def test_export_returns_a_new_tensor_and_empty_lists_work(ops: AttentionOps) -> None:
    geometry = (8, 2, 32)
    cache, _ = _caches(ops, geometry, torch.float32)
    before = cache.clone()
    _export(ops, cache, _ids(1, 3), geometry).fill_(7.0)
    assert torch.equal(cache, before)
    empty = torch.empty(0, dtype=torch.int64)
    assert _export(ops, cache, empty, geometry).shape == (2, 0, *geometry)
    ops.import_blocks(cache, empty, torch.zeros(2, 0, *geometry))
    assert torch.equal(cache, before)


BAD_EXPORTS = {
    "id-negative": (_ids(0, -1), {}, "block ids [-1] are out of range: the cache has 6 blocks"),
    "id-past-end": (_ids(6, 2), {}, "block ids [6] are out of range"),
    "ids-2d": (torch.zeros(1, 2, dtype=torch.int64), {}, "1-D int64 tensor, not 2-D"),
    "ids-int32": (torch.zeros(2, dtype=torch.int32), {}, "not 1-D torch.int32"),
    "block-size": (_ids(0), {"block_size": 16}, "block_size 16"),
    "head-size": (_ids(0), {"head_size": 48}, "head_size 48"),
}


@pytest.mark.parametrize("ops", [_cpu_ops("torch"), ReferenceAttentionOps()], ids=["cpu", "ref"])
@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_export_refuses_invalid_arguments(ops: AttentionOps, case: str) -> None:
    ids, sizes, message = BAD_EXPORTS[case]
    cache = torch.zeros(ops.kv_cache_shape(NUM_BLOCKS, 8, 2, 32))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ops.export_blocks(cache, ids, **{"block_size": 8, "head_size": 32, **sizes})


BAD_IMPORTS = {
    "id-past-end": (_ids(0, 9), (2, 2, 8, 2, 32), "block ids [9] are out of range"),
    "ids-repeat": (_ids(1, 1), (2, 2, 8, 2, 32), "block ids repeat: [1, 1]"),
    "count": (_ids(0, 1), (2, 3, 8, 2, 32), "are not 2 canonical blocks"),
    "not-5d": (_ids(0), (2, 1, 8, 64), "are not 1 canonical blocks"),
    "heads": (_ids(0), (2, 1, 8, 4, 32), "do not fit"),
    "head-size": (_ids(0), (2, 1, 8, 2, 16), "do not fit"),
    "block-size": (_ids(0), (2, 1, 4, 2, 32), "do not fit"),
}


@pytest.mark.parametrize("ops", [_cpu_ops("torch"), ReferenceAttentionOps()], ids=["cpu", "ref"])
@pytest.mark.parametrize("case", list(BAD_IMPORTS))
def test_import_refuses_invalid_arguments(ops: AttentionOps, case: str) -> None:
    ids, shape, message = BAD_IMPORTS[case]
    cache = torch.zeros(ops.kv_cache_shape(NUM_BLOCKS, 8, 2, 32))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ops.import_blocks(cache, ids, torch.ones(shape))
    assert not cache.any()


class FlatLayoutOps(ReferenceAttentionOps):
    """A backend whose cache keeps each block flat and that forgot to override the transfer."""

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size * num_kv_heads * head_size)


def test_the_defaults_refuse_a_layout_other_than_the_canonical_one() -> None:
    ops = FlatLayoutOps()
    cache = torch.zeros(ops.kv_cache_shape(NUM_BLOCKS, 8, 2, 32))
    message = "FlatLayoutOps.*differs from the canonical one.*override export_blocks and import"
    with pytest.raises(UnsupportedByBackendError, match=message):
        ops.export_blocks(cache, _ids(0), block_size=8, head_size=32)
    with pytest.raises(UnsupportedByBackendError, match=message):
        ops.import_blocks(cache, _ids(0), torch.zeros(2, 1, 8, 2, 32))
