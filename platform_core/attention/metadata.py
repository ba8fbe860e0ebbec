"""What the input builder hands to a backend's attention ops for one model step.

The batch is flattened: the new (query) tokens of every scheduled sequence are concatenated,
sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``. A prefill chunk and a
decode step look the same: sequence ``i`` has ``seq_lens[i]`` tokens in total after this step, and
its queries are the last ``q_len_i`` of them, attending causally to every earlier token of the same
sequence (the cached prefix included) and to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Tensors describing one flattened batch; all live on the backend's device.

    Attributes:
        query_start_loc: int32 ``[num_seqs + 1]``, cumulative query lengths starting at 0.
        seq_lens: int32 ``[num_seqs]``, total tokens of each sequence after this step.
        block_tables: int32 ``[num_seqs, max_blocks]``, physical block ids of each sequence in
            order; entries past a sequence's last block are padding and must not be read.
        slot_mapping: int64 ``[num_tokens]``, cache slot (``block_id * block_size + offset``) each
            new token's K/V is written to; ``-1`` marks a padding token that writes nothing.
        max_query_len: the longest query of the batch (1 for a decode-only batch).
        max_seq_len: the longest ``seq_lens`` entry.
        block_size: tokens per KV block.
        query_start_loc_cpu / seq_lens_cpu: host copies, so kernels and Python code can plan
            without a device round-trip.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
