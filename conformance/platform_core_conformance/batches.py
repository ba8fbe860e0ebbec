"""Synthetic paged-attention batches, run through a backend's ops and through the reference.

A case holds the keys and values of every token of every sequence, the queries of the tokens
computed in this step, and random non-contiguous block tables. The backend's cache is filled the
way the engine fills it (earlier steps first, then this step's tokens with ``-1`` padding rows
between them); the reference gets the same values in its own float32 cache.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from platform_core.backend_api import (
    AttentionMetadata,
    AttentionOps,
    reference_kv_cache_shape,
    reference_paged_attention,
    reference_write_kv,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PADDING_VALUE = 1e3  # K/V of padding rows: ruins any output it leaks into


@dataclass(frozen=True, slots=True)
class Seq:
    """One sequence: ``cached`` tokens written in earlier steps, ``new`` computed in this one."""

    cached: int
    new: int

    @property
    def total(self) -> int:
        return self.cached + self.new


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Head layout, block size and dtype of one check."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


@dataclass(slots=True)
class AttentionCase:
    """Inputs of one check, on the host: queries ``[new tokens, H, D]``, per-sequence K/V
    ``[total, KVH, D]`` (already rounded to the dtype) and the metadata of this step."""

    shape: AttentionShape
    seqs: list[Seq]
    query: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tables: list[list[int]]
    num_blocks: int
    metadata: AttentionMetadata

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.head_size)

    def slots(self, i: int, start: int, end: int) -> list[int]:
        """Cache slots of tokens ``start:end`` of sequence ``i``."""
        return _slots(self.tables[i], self.shape.block_size, start, end)

    def locate(self, index: tuple[int, ...]) -> str:
        """Where element ``(query token, head, dim)`` of an output is: sequence, position, head."""
        token, head, dim = index
        for i, seq in enumerate(self.seqs):
            if token < seq.new:
                ratio = self.shape.num_heads // self.shape.num_kv_heads
                return (
                    f"sequence {i} (cached {seq.cached}, new {seq.new}) token position "
                    f"{seq.cached + token}, head {head} (kv head {head // ratio}), dim {dim}"
                )
            token -= seq.new
        raise IndexError(f"token {index[0]} is past the case's {len(self.query)} query tokens")


def _slots(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def make_case(
    shape: AttentionShape,
    seqs: list[Seq],
    seed: int,
    spare_blocks: int = 2,
    magnitude: float = 1.0,
) -> AttentionCase:
    """Random inputs for ``seqs``; the block pool has ``spare_blocks`` unused blocks or more.

    ``magnitude`` scales queries and keys by its square root (scores by ``magnitude``: a peaked
    softmax) and values by ``magnitude``.
    """
    gen = torch.Generator().manual_seed(seed)
    dtype, size = shape.torch_dtype, shape.block_size
    needed = [-(-s.total // size) for s in seqs]
    num_blocks = sum(needed) + max(spare_blocks, sum(needed) // 2)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    if num_blocks - 1 not in pool[: sum(needed)]:
        # The last block (where a "-1 means the end" bug would write) is always in use.
        pool[0] = num_blocks - 1
    tables, used = [], 0
    for count in needed:
        tables.append(pool[used : used + count])
        used += count

    def rand(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(dims, generator=gen)).to(dtype)

    kv_dims = (shape.num_kv_heads, shape.head_size)
    qk = math.sqrt(magnitude)
    return AttentionCase(
        shape=shape,
        seqs=seqs,
        query=rand(sum(s.new for s in seqs), shape.num_heads, shape.head_size, scale=qk),
        keys=[rand(s.total, *kv_dims, scale=qk) for s in seqs],
        values=[rand(s.total, *kv_dims, scale=magnitude) for s in seqs],
        tables=tables,
        num_blocks=num_blocks,
        metadata=build_metadata(seqs, tables, size),
    )


def build_metadata(seqs: list[Seq], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """The host-side metadata of one step over ``seqs`` with these block tables."""
    starts = [0]
    for seq in seqs:
        starts.append(starts[-1] + seq.new)
    table_tensor = torch.zeros(len(seqs), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):  # entries past a sequence's blocks stay 0, as the engine
        table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [
        slot
        for table, seq in zip(tables, seqs)
        for slot in _slots(table, block_size, seq.cached, seq.total)
    ]
    lens = [seq.total for seq in seqs]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=table_tensor,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(seq.new for seq in seqs),
        max_seq_len=max(lens),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


def relocated(case: AttentionCase, moves: dict[int, int]) -> AttentionCase:
    """The same case with each block ``src`` of its tables replaced by ``moves[src]``."""
    tables = [[moves[block] for block in table] for table in case.tables]
    metadata = build_metadata(case.seqs, tables, case.shape.block_size)
    return dataclasses.replace(case, tables=tables, metadata=metadata)


def metadata_on(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of ``metadata`` whose tensors live on ``device``."""
    tensors = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    return dataclasses.replace(
        metadata, **{name: getattr(metadata, name).to(device) for name in tensors}
    )


def expected_output(case: AttentionCase) -> torch.Tensor:
    """The reference output (float32) for the case's rounded inputs."""
    shape = case.shape
    cache = torch.zeros(
        reference_kv_cache_shape(
            case.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size
        )
    )
    for i, seq in enumerate(case.seqs):
        slots = torch.tensor(case.slots(i, 0, seq.total), dtype=torch.int64)
        reference_write_kv(case.keys[i].float(), case.values[i].float(), cache, slots)
    return reference_paged_attention(case.query.float(), cache, case.metadata, case.scale)


def new_cache(ops: AttentionOps, case: AttentionCase, device: torch.device) -> torch.Tensor:
    """A zeroed cache in the backend's layout for the case's block pool."""
    shape = case.shape
    dims = ops.kv_cache_shape(
        case.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size
    )
    return torch.zeros(dims, dtype=shape.torch_dtype, device=device)


def write_step(
    ops: AttentionOps,
    cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: list[int],
    padding_every: int = 3,
) -> None:
    """``write_kv`` one step's tokens with a ``-1`` padding row (full of ``PADDING_VALUE``)
    before every ``padding_every``-th token, the first one included."""
    rows, row_slots = [], []
    pad = torch.full((1, *keys.shape[1:]), PADDING_VALUE, dtype=keys.dtype)
    for index, slot in enumerate(slots):
        if index % padding_every == 0:
            rows.append(-1)
            row_slots.append(-1)
        rows.append(index)
        row_slots.append(slot)
    order = torch.tensor(rows)
    real = order >= 0
    padded_keys = torch.where(real[:, None, None], keys[order.clamp(min=0)], pad)
    padded_values = torch.where(real[:, None, None], values[order.clamp(min=0)], pad)
    device = cache.device
    ops.write_kv(
        padded_keys.to(device),
        padded_values.to(device),
        cache,
        torch.tensor(row_slots, dtype=torch.int64, device=device),
    )


def fill_cache(ops: AttentionOps, case: AttentionCase, cache: torch.Tensor) -> None:
    """Write every token's K/V: the cached ones as one earlier step, then this step's."""
    for part in ("cached", "new"):
        keys, values, slots = [], [], []
        for i, seq in enumerate(case.seqs):
            start, end = (0, seq.cached) if part == "cached" else (seq.cached, seq.total)
            keys.append(case.keys[i][start:end])
            values.append(case.values[i][start:end])
            slots += case.slots(i, start, end)
        if slots:
            write_step(ops, cache, torch.cat(keys), torch.cat(values), slots)


def run_forward(
    ops: AttentionOps, case: AttentionCase, cache: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The backend's attention output for the case; fails if ``forward`` changed the cache."""
    before = cache.clone()
    out = ops.forward(case.query.to(device), cache, metadata_on(case.metadata, device), case.scale)
    assert torch.equal(cache, before), "forward must not modify the KV cache"
    assert out.dtype == case.query.dtype, f"forward returned {out.dtype}, not {case.query.dtype}"
    return out
