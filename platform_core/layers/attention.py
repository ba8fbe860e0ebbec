"""The attention layer: stores this step's K/V in the paged cache and attends over it.

It owns no weights; it adapts flat ``[T, heads * head_size]`` projections to a backend's
:class:`~platform_core.plugins.interfaces.AttentionOps` (``write_kv`` then ``forward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.plugins.interfaces import AttentionOps


class PagedAttention(nn.Module):
    """Causal paged attention of one decoder layer."""

    def __init__(
        self,
        ops: AttentionOps,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.ops = ops
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, H_kv, D]`` (``value`` may be a strided
        view) -> ``[T, H * D]``. Writes ``key``/``value`` into ``kv_cache`` at the slot mapping."""
        self.ops.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = self.ops.forward(query, kv_cache, metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, scale={self.scale:.4g}"
        )
