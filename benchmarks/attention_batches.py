"""Paged-attention batches for the attention benchmarks: scattered blocks, random data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from platform_core.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Heads, head size and dtype of one benchmarked attention layer."""

    heads: int
    kv_heads: int
    head_size: int
    dtype: torch.dtype


def build(
    specs: list[tuple[int, int]],
    block_size: int,
    shape: AttentionShape,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query, canonical-layout cache and metadata for ``(seq_len, query_len)`` sequences.

    Block tables are a random permutation, so each sequence's blocks are scattered in the cache.
    """
    gen = torch.Generator().manual_seed(0)
    counts = [-(-seq_len // block_size) for seq_len, _ in specs]
    order = torch.randperm(sum(counts), generator=gen).int()
    tables = torch.zeros(len(specs), max(counts), dtype=torch.int32)
    for i, used in enumerate(torch.tensor(counts).cumsum(0).tolist()):
        tables[i, : counts[i]] = order[used - counts[i] : used]
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    lens = [seq_len for seq_len, _ in specs]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(lens),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    cache_shape = (2, sum(counts), block_size, shape.kv_heads, shape.head_size)
    cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    query = torch.randn(starts[-1], shape.heads, shape.head_size, device=device, dtype=shape.dtype)
    return query, cache, metadata
