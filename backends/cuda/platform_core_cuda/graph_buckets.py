"""Batch-size buckets and static input buffers for CUDA-graph decode steps.

A captured graph replays fixed kernels on fixed addresses, so a decode batch of ``n`` sequences
runs in the graph of the smallest captured size ``>= n``: its inputs are copied into static
buffers and the ``size - n`` rows left over become padding sequences. A padding sequence has one
query token at position 0, ``seq_len`` 1, a block table of zeros and slot ``-1``: it writes
nothing to the cache and reads one valid (if unrelated) cache entry, so its rows stay finite
and are dropped after the replay. Everything here is plain tensor code, tested on the CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from platform_core.backend_api import AttentionMetadata


def capture_sizes(max_num_seqs: int, limit: int = 256) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to the cap."""
    cap = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s < cap] + list(range(8, cap + 1, 8))
    if not sizes or sizes[-1] < cap:
        sizes.append(cap)
    return tuple(sizes)


def bucket_for(sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest captured size holding ``num_seqs`` sequences; ``None`` if none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class DecodeBuffers:
    """The static tensors every captured decode graph reads (one token per sequence)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> DecodeBuffers:
        """Buffers for batches of up to ``max_size`` sequences, initialised as padding."""
        return cls(
            input_ids=torch.zeros(max_size, dtype=torch.int64, device=device),
            positions=torch.zeros(max_size, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_size,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(
                (max_size, max_blocks_per_seq), dtype=torch.int32, device=device
            ),
            block_size=block_size,
        )

    def inputs(
        self, size: int, max_seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the first ``size`` rows: what a graph of that size is captured with.

        ``max_seq_len`` is a host-side bound (the model's context); kernels read the real
        lengths from ``seq_lens``.
        """
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
        )
        return self.input_ids[:size], self.positions[:size], metadata

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        size: int,
    ) -> None:
        """Copy a decode batch into the first rows and make rows up to ``size`` padding.

        Device-side copies only: no host synchronisation.
        """
        n = metadata.num_seqs
        if metadata.num_tokens != n or not metadata.is_decode_only or n > size:
            raise ValueError(f"fill needs a decode-only batch of at most {size} sequences")
        width = metadata.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block table width {width} exceeds the captured {self.block_tables.shape[1]}"
            )
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size].zero_()
