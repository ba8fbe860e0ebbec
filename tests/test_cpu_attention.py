"""CPU backend paged attention: compiled kernel and torch fallback against the reference ops.

Each batch is written into the cache through the path's own ``write_kv`` (in the backend's
tile layout) and through ``reference_write_kv`` (canonical layout), then both forwards are
compared. The compiled kernel is checked in the build of every ISA level this CPU runs (an
AVX-512 machine tests the AVX2 build too); each build is compiled once per machine and cached
(see ``kernels.py``).
"""

from __future__ import annotations

import logging
import random

import platform_core_cpu.attention as cpu_attention
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from platform_core_cpu import kernels
from platform_core_cpu.attention import KERNEL_ENV, CpuAttentionOps, key_tokens, value_tokens
from platform_core_cpu.isa import host_isa

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import (
    reference_kv_cache_shape,
    reference_paged_attention,
    reference_write_kv,
)
from platform_core.errors import BackendError, ConfigError

# "compiled-<level>" for each ISA level this CPU runs, and the torch fallback.
PATHS = (*(f"compiled-{level}" for level in host_isa().supported), "torch")
COMPILED = f"compiled-{host_isa().level}"


def make_ops(path: str) -> CpuAttentionOps:
    """The ops of one entry of ``PATHS``."""
    mode, _, level = path.partition("-")
    return CpuAttentionOps(mode, level=level or None)


KV_HEADS = 2
PAD_BLOCK = 10**6  # table padding: a kernel that reads it crashes or fails the comparison


@pytest.fixture(scope="module")
def ops() -> dict[str, CpuAttentionOps]:
    return {path: make_ops(path) for path in PATHS}


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """(seq_len, query_len) pairs covering the awkward cases of a mixed batch."""
    bs = block_size
    return [
        (1, 1),  # one-token sequence
        (bs, 1),  # decode ending exactly on a block boundary
        (bs + 1, 1),  # decode just past a boundary
        (5 * bs - 1, 1),
        (2 * bs, bs),  # prefill chunk ending on a boundary, one cached block before it
        (3 * bs + 5, 2 * bs + 3),  # chunk after an unaligned cached prefix
        (2 * bs + 1, 2 * bs + 1),  # whole prompt, several query tiles
        (7, 0),  # scheduled with no new tokens: nothing to compute
    ]


def build_batch(
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query, per-token K/V of every sequence, their slots and the metadata of one step.

    Blocks come from a shuffled pool (non-contiguous tables, padded with ``PAD_BLOCK``); K/V and
    slots cover every token of every sequence, with ``-1`` padding rows interleaved.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-seq_len // block_size) for seq_len, _ in specs]
    pool = list(range(sum(counts) + 3))
    random.Random(seed).shuffle(pool)
    tables = torch.full((len(specs), max(counts) + 1), PAD_BLOCK, dtype=torch.int32)
    slots, q_slots = [], []
    for i, (seq_len, q_len) in enumerate(specs):
        ids = [pool.pop() for _ in range(counts[i])]
        tables[i, : counts[i]] = torch.tensor(ids)
        seq_slots = [ids[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        slots += [*seq_slots, -1]
        q_slots += seq_slots[seq_len - q_len :]
    kv_rows = len(slots)
    key = torch.randn(kv_rows, kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(kv_rows, kv_heads, head_size, generator=gen).to(dtype)
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    lens = [seq_len for seq_len, _ in specs]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(q_slots, dtype=torch.int64),
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(lens),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    query = torch.randn(starts[-1], heads, head_size, generator=gen).to(dtype)
    return query, key, value, torch.tensor(slots, dtype=torch.int64), metadata


def run_both(
    ops: CpuAttentionOps,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, float32 reference output over the same inputs)."""
    query, key, value, slots, metadata = batch
    num_blocks = int(metadata.block_tables[metadata.block_tables < PAD_BLOCK].max()) + 4
    kv_heads, head_size, block_size = key.shape[1], key.shape[2], metadata.block_size
    cache = torch.zeros(ops.kv_cache_shape(num_blocks, block_size, kv_heads, head_size))
    cache = cache.to(query.dtype)
    ops.write_kv(key, value, cache, slots)
    canonical = torch.zeros(reference_kv_cache_shape(num_blocks, block_size, kv_heads, head_size))
    reference_write_kv(key.float(), value.float(), canonical, slots)
    scale = head_size**-0.5
    expected = reference_paged_attention(query.float(), canonical, metadata, scale)
    return ops.forward(query, cache, metadata, scale), expected


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_reference(ops, path, dtype, block_size, head_size, group):
    specs = mixed_specs(block_size)
    batch = build_batch(specs, KV_HEADS * group, KV_HEADS, head_size, block_size, dtype)
    out, expected = run_both(ops[path], batch)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("group", "head_size", "block_size"),
    # Sizes off the vector width (tails of keys and dims); 64 query rows per KV head (MQA-like).
    [(8, 80, 6), (3, 40, 10), (64, 16, 2)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unusual_shapes(ops, path, group, head_size, block_size, dtype):
    specs = [(block_size * 4 + 3, block_size * 2), (1, 1), (block_size + 1, 1)]
    batch = build_batch(specs, group, 1, head_size, block_size, dtype, seed=3)
    out, expected = run_both(ops[path], batch)
    assert_matches(out, expected, dtype)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(st.integers(1, 80), st.integers(0, 80)).map(lambda t: (t[0], min(t))),
        min_size=1,
        max_size=6,
    ),
    block_size=st.sampled_from([2, 4, 16, 32]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_random_batches_match_reference(seqs, block_size, group, seed):
    batch = build_batch(seqs, 2 * group, 2, 32, block_size, torch.float32, seed=seed)
    for path in PATHS:
        out, expected = run_both(make_ops(path), batch)
        assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_prompt_chunks_match_reference(ops, path, dtype):
    """The three 1,536-token chunks of a 4,608-token prompt (the last behind 3,072 cached
    tokens) at the default model's shape: 9 query / 3 KV heads of 64, blocks of 128. Scores
    spread as a trained model's do (most probabilities underflow, running maxima move)."""
    chunk = 1536
    specs = [(end, chunk) for end in (chunk, 2 * chunk, 3 * chunk)]
    query, *rest = build_batch(specs, 9, 3, 64, 128, dtype, seed=5)
    out, expected = run_both(ops[path], (query * 4, *rest))
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_strided_query_view(ops, path):
    """A query sliced out of a fused QKV projection (non-contiguous rows) is read correctly."""
    query, key, value, slots, metadata = build_batch(mixed_specs(16), 4, 2, 64, 16, torch.float32)
    fused = torch.randn(query.shape[0], 8, 64)
    fused[:, 2:6] = query
    out, expected = run_both(ops[path], (fused[:, 2:6], key, value, slots, metadata))
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_reference(ops, path, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, head_size = 6, 4, 3, 8
    # Runs of consecutive slots (a prefill's) share value words; others are written alone.
    slots = torch.tensor([5, -1, 0, 1, 23, -1, 16, 17, 4, 12, 13], dtype=torch.int64)
    key = torch.randn(len(slots), 2 * heads, head_size, generator=gen)[:, heads:]  # strided rows
    value = torch.randn(len(slots), head_size, heads, generator=gen).transpose(1, 2)  # strided D
    cache = torch.full(ops[path].kv_cache_shape(num_blocks, block_size, heads, head_size), 7.0)
    cache = cache.to(dtype)
    canonical = torch.full(reference_kv_cache_shape(num_blocks, block_size, heads, head_size), 7.0)
    canonical = canonical.to(dtype)
    ops[path].write_kv(key, value, cache, slots)
    reference_write_kv(key, value, canonical, slots)
    keys, values = key_tokens(cache[0], head_size), value_tokens(cache[1], head_size)
    shape = (num_blocks, heads, block_size, head_size)
    assert torch.equal(keys.reshape(shape), canonical[0].transpose(1, 2))
    assert torch.equal(values.reshape(shape), canonical[1].transpose(1, 2))
    written = int((slots >= 0).sum())
    assert (cache == 7.0).sum() == 2 * (num_blocks * block_size - written) * heads * head_size


def test_kv_cache_shape_is_one_tile_per_block_and_head():
    ops = CpuAttentionOps("torch")
    assert ops.kv_cache_shape(10, 16, 4, 64) == (2, 10, 4, 16 * 64)
    with pytest.raises(ConfigError, match="must be even"):
        ops.kv_cache_shape(10, 5, 4, 64)


def test_env_var_selects_the_path(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert CpuAttentionOps().kernel == "torch"
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert CpuAttentionOps().kernel == "compiled"  # the build must work where tests run
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ConfigError, match="compiled"):
        CpuAttentionOps()


def test_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    failed = kernels.KernelBuild(None, "RuntimeError: no compiler here", 0.0)
    monkeypatch.setattr(cpu_attention, "load_kernels", lambda level: failed)
    auto = CpuAttentionOps("auto")
    with caplog.at_level(logging.WARNING, logger="platform_core_cpu"):
        assert auto.kernel == "torch"
    assert "no compiler here" in caplog.text
    batch = build_batch(mixed_specs(16), 4, 2, 64, 16, torch.float32)
    out, expected = run_both(auto, batch)
    assert_matches(out, expected, torch.float32)
    with pytest.raises(BackendError, match="no compiler here"):
        _ = CpuAttentionOps("compiled").kernel


def test_compiled_kernel_rejects_out_of_range_blocks(ops):
    query, *_, metadata = build_batch([(20, 4)], 2, 2, 16, 8, torch.float32)
    cache = torch.zeros(ops[COMPILED].kv_cache_shape(4, 8, 2, 16))
    metadata.block_tables[0, 1] = 4  # one past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        ops[COMPILED].forward(query, cache, metadata, 0.25)
