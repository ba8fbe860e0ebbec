"""Paged attention through intel-extension-for-pytorch (``ipex.llm.modules.PagedAttention``).

Used instead of the shared Triton kernels when an IPEX matching torch is installed. Cache layout
is the canonical one (keys and values each ``[num_blocks, block_size, num_kv_heads,
head_size]``), the layout IPEX's ``reshape_and_cache`` documents. Written against IPEX's
documented API (``reshape_and_cache`` and ``flash_attn_varlen_func`` with fp8 scales); it runs
only on an XPU machine and is untested in CPU CI.
"""

from __future__ import annotations

import torch

from platform_core.backend_api import AttentionMetadata, AttentionOps, reference_kv_cache_shape


class IpexAttentionOps(AttentionOps):
    """IPEX's paged-attention kernels behind the ``AttentionOps`` interface."""

    def __init__(self) -> None:
        from intel_extension_for_pytorch.llm.modules import PagedAttention

        self._ipex = PagedAttention

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """``[2, num_blocks, block_size, num_kv_heads, head_size]``."""
        return reference_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # IPEX does not document skipping negative slots, so padding is dropped here.
        valid = slot_mapping >= 0
        self._ipex.reshape_and_cache(
            key[valid].to(kv_cache.dtype),
            value[valid].to(kv_cache.dtype),
            kv_cache[0],
            kv_cache[1],
            slot_mapping[valid],
            1.0,
            1.0,
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        q = query.to(kv_cache.dtype).contiguous()
        out = torch.empty_like(q)
        cu_seqlens_kv = torch.zeros_like(metadata.query_start_loc)
        torch.cumsum(metadata.seq_lens, 0, out=cu_seqlens_kv[1:])
        self._ipex.flash_attn_varlen_func(
            out,
            q,
            kv_cache[0],
            kv_cache[1],
            metadata.query_start_loc,
            cu_seqlens_kv,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            True,  # causal, aligned to the end of each sequence
            metadata.block_tables,
            1.0,
            1.0,
            None,
        )
        return out.to(query.dtype)
