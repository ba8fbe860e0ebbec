"""The one place that turns a ``SchedulerOutput`` into model inputs.

``build_host`` fills numpy arrays (no per-token Python loops); ``to_device`` moves them to the
backend's device once. The host batch is plain data, cheap to send to other ranks. Backends
receive the device tensors; they never rebuild them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class HostBatch:
    """One flattened batch as numpy arrays (see ``AttentionMetadata`` for the fields).

    ``sample_rows`` are the indices (into the scheduled list) of requests that sample this step;
    ``logits_indices`` the flattened rows whose logits they need: one per request, or ``k + 1``
    consecutive rows for a request with ``k`` drafts.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    sample_rows: list[int]
    logits_indices: np.ndarray
    block_size: int


@dataclass(slots=True)
class ModelInput:
    """Device tensors for one forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


class InputBuilder:
    """Builds batches for a fixed block size and device."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def build(self, output: SchedulerOutput) -> ModelInput:
        return self.to_device(self.build_host(output))

    def build_host(self, output: SchedulerOutput) -> HostBatch:
        """Flatten the scheduled requests in order into one batch."""
        requests = output.scheduled
        num_seqs = len(requests)
        q_lens = np.fromiter((r.num_tokens for r in requests), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((r.start_position for r in requests), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + q_lens

        input_ids = np.fromiter(
            (t for r in requests for t in r.token_ids), dtype=np.int64, count=num_tokens
        )
        # Position of each token: its sequence's start plus its offset within the query.
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1], q_lens)
        positions += starts[seq_of_token]

        max_blocks = max((len(r.block_ids) for r in requests), default=0)
        block_tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
        for i, request in enumerate(requests):
            block_tables[i, : len(request.block_ids)] = request.block_ids
        block_of_token = block_tables[seq_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size

        sample_rows = [i for i, r in enumerate(requests) if r.sample]
        num_scored = np.fromiter(
            (requests[i].num_draft_tokens + 1 for i in sample_rows), np.int64, len(sample_rows)
        )
        # Row j of a request's scored block is (end - num_scored + j).
        first = np.repeat(query_start_loc[1:][sample_rows] - num_scored, num_scored)
        offsets = np.arange(int(num_scored.sum())) - np.repeat(
            np.cumsum(num_scored) - num_scored, num_scored
        )
        return HostBatch(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            sample_rows=sample_rows,
            logits_indices=first + offsets,
            block_size=self.block_size,
        )

    def to_device(self, host: HostBatch) -> ModelInput:
        """Move a host batch to the device as model input."""
        to_device = self._to_device
        q_lens = np.diff(host.query_start_loc)
        metadata = AttentionMetadata(
            query_start_loc=to_device(host.query_start_loc, torch.int32),
            seq_lens=to_device(host.seq_lens, torch.int32),
            block_tables=to_device(host.block_tables, torch.int32),
            slot_mapping=to_device(host.slot_mapping, torch.int64),
            max_query_len=int(q_lens.max(initial=0)),
            max_seq_len=int(host.seq_lens.max(initial=0)),
            block_size=host.block_size,
            query_start_loc_cpu=host.query_start_loc.tolist(),
            seq_lens_cpu=host.seq_lens.tolist(),
        )
        return ModelInput(
            input_ids=to_device(host.input_ids, torch.int64),
            positions=to_device(host.positions, torch.int64),
            metadata=metadata,
            logits_indices=to_device(host.logits_indices, torch.int64),
        )

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
