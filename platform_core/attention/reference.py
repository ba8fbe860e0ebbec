"""Pure-torch reference for the paged-attention ops: the oracle of tests and conformance.

Canonical KV-cache layout of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(index 0 keys, 1 values). Softmax runs in float32 whatever the cache dtype. Written for clarity,
not speed: one Python iteration per sequence.
"""

from __future__ import annotations

import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.plugins.interfaces import AttentionOps


def reference_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """Shape of one layer's KV cache in the canonical layout."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def reference_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the cache.

    Tokens whose slot is ``-1`` are padding and are skipped.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[valid].to(kv_cache.dtype)


def reference_export_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` of a canonical cache as a new tensor ``[2, n, block_size,
    num_kv_heads, head_size]``: the canonical layout KV connectors move blocks in."""
    return kv_cache[:, block_ids.long()]


def reference_import_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor
) -> None:
    """Write canonical ``blocks`` ``[2, n, block_size, num_kv_heads, head_size]`` into a
    canonical cache at ``block_ids``, converted to its dtype and device."""
    kv_cache[:, block_ids.long()] = blocks.to(kv_cache.device, kv_cache.dtype)


def gather_sequence_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len, num_kv_heads, head_size]`` of one sequence, in token order."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    keys = kv_cache[0, ids].flatten(0, 1)[:seq_len]
    values = kv_cache[1, ids].flatten(0, 1)[:seq_len]
    return keys, values


def reference_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the paged cache.

    Returns ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype. Grouped-query attention:
    query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, metadata.block_tables[i], seq_len)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q, D]
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, s, D]
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q, s]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


class ReferenceAttentionOps(AttentionOps):
    """The reference functions behind the ``AttentionOps`` interface (any device, slow).

    Used as the oracle by tests and conformance, and as the attention of minimal backends such
    as the vendor template.
    """

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return reference_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference_write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference_paged_attention(query, kv_cache, metadata, scale)
