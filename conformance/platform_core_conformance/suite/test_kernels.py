"""The backend's paged-attention ops against the reference, across its declared capabilities.

Each check writes K/V through the slot mapping (with ``-1`` padding rows between real tokens),
runs ``forward`` on random non-contiguous block tables, and compares with the reference computed
from the same rounded inputs; the measured error and the dtype's tolerance go to the report, and
a failure names the worst sequence, token position and head with both values. ``write_kv`` and
padding are checked first, on their own; the other checks skip when they failed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from platform_core.backend_api import Backend
from platform_core_conformance.batches import (
    PADDING_VALUE,
    AttentionShape,
    Seq,
    expected_output,
    fill_cache,
    make_case,
    new_cache,
    relocated,
    run_forward,
    write_step,
)
from platform_core_conformance.tolerances import Comparison, compare, tolerance_for

NUM_HEADS = 8
GQA_HEADS = 16  # every ratio of the GQA check keeps at least two KV heads
LARGE_MAGNITUDE = 16.0  # scores of std 16 (a peaked softmax), values of std 16

pytestmark = pytest.mark.requires("write_kv", "padding")


def _long(b: int) -> int:
    return max(300, 4 * b + 1)


# Batches as functions of the block size b; sequences with no new token are dropped (b = 1).
SCENARIOS: dict[str, Callable[[int], list[Seq]]] = {
    "decode": lambda b: [Seq(c, 1) for c in (0, 1, b - 1, b, 2 * b, 3 * b + 2)],
    "prefill": lambda b: [Seq(0, n) for n in (1, b - 1, b, b + 1, 2 * b + 3)],
    "prefill_after_cached_prefix": lambda b: [Seq(b, 3), Seq(2 * b, b), Seq(b + 3, b + 2)],
    "mixed": lambda b: [Seq(5, 1), Seq(0, b + 1), Seq(b, 1), Seq(2 * b - 1, b + 1), Seq(b - 1, 1)],
    "one_token": lambda b: [Seq(0, 1)],
    "long": lambda b: [Seq(0, _long(b)), Seq(_long(b) - 1, 1), Seq(_long(b) - b, b)],
    # Sequences ending exactly on a block boundary and one token past it.
    "block_boundaries": lambda b: [
        Seq(b - 1, 1),
        Seq(b, 1),
        Seq(0, 2 * b),
        Seq(0, 2 * b + 1),
        Seq(b, b),
        Seq(b, b + 1),
        Seq(3 * b - 1, 1),
    ],
}


def scenario(name: str, block_size: int) -> list[Seq]:
    return [s for s in SCENARIOS[name](block_size) if s.new > 0]


def check_attention(
    backend: Backend,
    shape: AttentionShape,
    seqs: list[Seq],
    record_error: Callable[[Comparison], None],
    seed: int = 0,
    magnitude: float = 1.0,
) -> None:
    """Write, attend, compare; fail with the measured error and where it is worst."""
    case = make_case(shape, seqs, seed, magnitude=magnitude)
    cache = new_cache(backend.attention, case, backend.device)
    fill_cache(backend.attention, case, cache)
    out = run_forward(backend.attention, case, cache, backend.device)
    backend.synchronize()
    tolerance = tolerance_for(shape.dtype)
    comparison = compare(out, expected_output(case), tolerance, scale=magnitude)
    record_error(comparison)
    comparison.check(case.locate, "attention forward vs reference")


@pytest.mark.prerequisite("write_kv")
def test_write_kv_stores_every_element(
    backend: Backend, dtype: str, base_head_size: int, base_block_size: int
) -> None:
    """Layout-free: writing N tokens of non-zero K/V changes exactly 2 * N * KVH * D elements,
    and rewriting the same slots changes the same elements."""
    b = base_block_size
    shape = AttentionShape(4, 2, base_head_size, b, dtype)
    case = make_case(shape, [Seq(0, 2 * b + 3), Seq(0, b + 1)], seed=6)
    cache = new_cache(backend.attention, case, backend.device)
    tokens = sum(seq.total for seq in case.seqs)
    expected = 2 * tokens * shape.num_kv_heads * shape.head_size

    def write(offset: float) -> torch.Tensor:
        for i, seq in enumerate(case.seqs):
            # Magnitudes in [offset, offset + 1): no element rounds to zero.
            keys = case.keys[i].sign() * (offset + case.keys[i].abs().clamp(max=1))
            slots = torch.tensor(case.slots(i, 0, seq.total), device=backend.device)
            values = keys.flip(-1).to(backend.device)
            backend.attention.write_kv(keys.to(backend.device), values, cache, slots)
        backend.synchronize()
        return cache != 0

    first = write(0.5)
    changed = int(first.sum())
    assert changed == expected, (
        f"write_kv of {tokens} tokens changed {changed} cache elements, expected {expected} "
        f"(2 x tokens x {shape.num_kv_heads} kv heads x head size {shape.head_size})"
    )
    moved = int((write(2.0) != first).sum())
    assert moved == 0, f"rewriting the same slots changed {moved} other cache elements"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_paged_attention(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    name: str,
    record_error: Callable[[Comparison], None],
) -> None:
    shape = AttentionShape(NUM_HEADS, 2, base_head_size, base_block_size, dtype)
    check_attention(backend, shape, scenario(name, base_block_size), record_error)


@pytest.mark.parametrize("num_kv_heads", [16, 8, 4, 2], ids=lambda k: f"gqa{GQA_HEADS // k}-kv{k}")
def test_gqa_ratios(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    num_kv_heads: int,
    record_error: Callable[[Comparison], None],
) -> None:
    shape = AttentionShape(GQA_HEADS, num_kv_heads, base_head_size, base_block_size, dtype)
    check_attention(backend, shape, scenario("mixed", base_block_size), record_error, seed=1)


def test_large_magnitude_inputs(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    record_error: Callable[[Comparison], None],
) -> None:
    shape = AttentionShape(NUM_HEADS, 2, base_head_size, base_block_size, dtype)
    seqs = scenario("mixed", base_block_size)
    check_attention(backend, shape, seqs, record_error, seed=7, magnitude=LARGE_MAGNITUDE)


def test_every_head_size(
    backend: Backend,
    dtype: str,
    head_size: int,
    base_block_size: int,
    record_error: Callable[[Comparison], None],
) -> None:
    shape = AttentionShape(4, 2, head_size, base_block_size, dtype)
    check_attention(backend, shape, scenario("mixed", base_block_size), record_error, seed=2)


def test_every_block_size(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    block_size: int,
    record_error: Callable[[Comparison], None],
) -> None:
    shape = AttentionShape(4, 2, base_head_size, block_size, dtype)
    check_attention(backend, shape, scenario("block_boundaries", block_size), record_error, seed=3)


@pytest.mark.prerequisite("padding")
def test_padding_slots_write_nothing(
    backend: Backend, dtype: str, base_head_size: int, base_block_size: int
) -> None:
    shape = AttentionShape(4, 2, base_head_size, base_block_size, dtype)
    case = make_case(shape, [Seq(0, 2 * base_block_size)], seed=4)
    cache = new_cache(backend.attention, case, backend.device)
    count = case.keys[0].shape[0]
    keys = torch.full_like(case.keys[0], PADDING_VALUE).to(backend.device)
    slots = torch.full((count,), -1, dtype=torch.int64, device=backend.device)
    backend.attention.write_kv(keys, keys.clone(), cache, slots)
    backend.synchronize()
    changed = int(torch.count_nonzero(cache))
    assert changed == 0, f"writing only -1 slots changed {changed} cache elements"


def test_copy_blocks_moves_whole_blocks(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    record_error: Callable[[Comparison], None],
) -> None:
    b = base_block_size
    shape = AttentionShape(4, 2, base_head_size, b, dtype)
    seqs = [Seq(2 * b + 3, 1), Seq(b, b + 2)]
    case = make_case(shape, seqs, seed=5, spare_blocks=sum(-(-s.total // b) for s in seqs))
    cache = new_cache(backend.attention, case, backend.device)
    fill_cache(backend.attention, case, cache)
    used = [block for table in case.tables for block in table]
    free = [block for block in range(case.num_blocks) if block not in set(used)]
    moves = dict(zip(used, free))
    device = backend.device
    src = torch.tensor(list(moves), dtype=torch.int64, device=device)
    dst = torch.tensor(list(moves.values()), dtype=torch.int64, device=device)
    backend.attention.copy_blocks(cache, src, dst)
    # Spoil the originals: the moved tables must be read from the copies alone.
    slots = [block * b + offset for block in used for offset in range(b)]
    spoil = torch.full((len(slots), 2, base_head_size), PADDING_VALUE, dtype=shape.torch_dtype)
    write_step(backend.attention, cache, spoil, spoil, slots)
    out = run_forward(backend.attention, relocated(case, moves), cache, device)
    backend.synchronize()
    comparison = compare(out, expected_output(case), tolerance_for(dtype))
    record_error(comparison)
    comparison.check(case.locate, "forward after copy_blocks")
