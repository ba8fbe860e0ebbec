"""The one place that turns a ``SchedulerOutput`` into model inputs.

``build_host`` fills numpy arrays in one pass over the requests (no per-token Python loops);
``to_device`` moves them to the backend's device once. The host batch is plain data, cheap to
send to other ranks. Backends receive the device tensors; they never rebuild them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.scheduler.output import ScheduledRequest, SchedulerOutput


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
    """Builds batches for a fixed block size and device.

    Keeps every running request's block table across steps (a row of ``_tables``): each step's
    ``ScheduledRequest`` carries only the blocks added since the last one. Rows are released for
    the ``finished_ids`` and ``preempted_ids`` of a ``SchedulerOutput``; a builder fed outputs
    that never finish requests (a draft model's) calls ``release`` itself.
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._tables = np.zeros((8, 8), dtype=np.int32)
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = list(range(7, -1, -1))

    @property
    def num_tables(self) -> int:
        """How many requests' block tables are kept."""
        return len(self._rows)

    def release(self, request_ids: list[str]) -> None:
        """Forget the block tables of requests that will not run again (unknown ids: ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def retain(self, request_ids: set[str]) -> None:
        """Forget the block tables of all requests not in ``request_ids``."""
        self.release([r for r in self._rows if r not in request_ids])

    def _table_row(self, request: ScheduledRequest) -> int:
        """The request's row of the kept tables, with this step's new blocks written in."""
        row = self._rows.get(request.request_id)
        if row is None:
            if request.first_block:
                raise RuntimeError(
                    f"request {request.request_id} sent blocks from {request.first_block} on, "
                    "but the runner holds no block table for it"
                )
            row = self._new_row(request.request_id)
        new_blocks = request.block_ids
        if new_blocks:
            end = request.first_block + len(new_blocks)
            if end > self._tables.shape[1]:
                self._grow(self._tables.shape[0], 2 * end)
            self._tables[row, request.first_block : end] = new_blocks
        return row

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            old = self._tables.shape[0]
            self._grow(2 * old, self._tables.shape[1])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._rows[request_id] = row
        return row

    def _grow(self, num_rows: int, num_columns: int) -> None:
        grown = np.zeros((num_rows, num_columns), dtype=np.int32)
        grown[: self._tables.shape[0], : self._tables.shape[1]] = self._tables
        self._tables = grown

    def build(self, output: SchedulerOutput) -> ModelInput:
        return self.to_device(self.build_host(output))

    def build_host(self, output: SchedulerOutput) -> HostBatch:
        """Flatten the scheduled requests in order into one batch."""
        self.release(output.finished_ids)
        self.release(output.preempted_ids)
        requests = output.scheduled
        num_seqs = len(requests)
        # One pass over the requests gathers every per-request value (this runs every step).
        q_lens_list, starts_list, token_ids, rows, num_blocks_list = [], [], [], [], []
        sample_rows, num_scored_list = [], []
        for i, request in enumerate(requests):
            tokens = request.token_ids
            q_lens_list.append(len(tokens))
            starts_list.append(request.start_position)
            token_ids += tokens
            rows.append(self._table_row(request))
            num_blocks_list.append(request.num_blocks)
            if request.sample:
                sample_rows.append(i)
                num_scored_list.append(request.num_draft_tokens + 1)
        q_lens = np.array(q_lens_list, dtype=np.int64)
        starts = np.array(starts_list, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + q_lens
        input_ids = np.array(token_ids, dtype=np.int64)
        # Position of each token: its sequence's start plus its offset within the query.
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1], q_lens)
        positions += starts[seq_of_token]

        num_blocks = np.array(num_blocks_list, dtype=np.int64)
        width = max(int(num_blocks.max(initial=0)), 1)
        block_tables = self._tables[np.array(rows, dtype=np.int64), :width]  # a copy
        block_tables[np.arange(width) >= num_blocks[:, None]] = 0  # past each request's blocks
        block_of_token = block_tables[seq_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size

        num_scored = np.array(num_scored_list, dtype=np.int64)
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
