"""The one place that turns a ``SchedulerOutput`` into device tensors.

Host-side arrays are filled with numpy (no per-token Python loops) and moved to the device once.
Backends receive the result; they never rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class ModelInput:
    """Everything one forward pass and its sampling need.

    ``logits_indices`` lists the rows of the flattened batch whose logits are sampled: one per
    request in ``sample_requests``, or ``k + 1`` consecutive rows for a request with ``k`` drafts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[ScheduledRequest]


class InputBuilder:
    """Builds ``ModelInput`` for a fixed block size and device."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def build(self, output: SchedulerOutput) -> ModelInput:
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
        # A request with k drafts has its last k + 1 positions scored (one per draft, plus one).
        num_scored = np.fromiter(
            (requests[i].num_draft_tokens + 1 for i in sample_rows), np.int64, len(sample_rows)
        )
        ends = np.repeat(query_start_loc[1:][sample_rows], num_scored)
        offsets = np.arange(int(num_scored.sum())) - np.repeat(
            np.cumsum(num_scored) - num_scored, num_scored
        )
        logits_indices = ends - np.repeat(num_scored, num_scored) + offsets

        to_device = self._to_device
        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            slot_mapping=to_device(slot_mapping, torch.int64),
            max_query_len=int(q_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=self.block_size,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return ModelInput(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            metadata=metadata,
            logits_indices=to_device(logits_indices, torch.int64),
            sample_requests=[requests[i] for i in sample_rows],
        )

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
