"""The attention layer: stores this step's K/V in the paged cache and attends over it.

It owns no weights; it adapts flat ``[T, heads * head_size]`` projections to a backend's
:class:`~platform_core.plugins.interfaces.AttentionOps` (``write_kv`` then ``forward``).
:class:`HeadShards` says which heads a tensor-parallel rank computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from platform_core.distributed.parallel_state import check_divisible
from platform_core.errors import ConfigError
from platform_core.layers.module import LayerModule
from platform_core.layers.sharding import Shard

if TYPE_CHECKING:
    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.plugins.interfaces import AttentionOps


class PagedAttention(LayerModule):
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


@dataclass(frozen=True, slots=True)
class HeadShards:
    """The attention heads of one tensor-parallel rank and the projection rows that compute them.

    Query heads are split evenly. KV heads are split evenly when there are at least as many as
    ranks; otherwise each is replicated on ``size // num_kv_heads`` consecutive ranks, which is
    exactly the ranks whose query heads read it.
    """

    num_heads: int
    num_kv_heads: int
    q_rows: Shard
    kv_rows: Shard

    @classmethod
    def for_rank(
        cls, num_heads: int, num_kv_heads: int, head_size: int, rank: int, size: int
    ) -> HeadShards:
        """Rank ``rank`` of ``size``; ConfigError when the heads cannot be split that way."""
        check_divisible(num_heads, size, "num_attention_heads")
        if num_kv_heads >= size:
            check_divisible(num_kv_heads, size, "num_key_value_heads")
            local_kv = num_kv_heads // size
            first_kv = rank * local_kv
        else:
            if size % num_kv_heads:
                raise ConfigError(
                    f"tensor_parallel_size={size} is not a multiple of "
                    f"num_key_value_heads={num_kv_heads}; KV heads fewer than ranks are "
                    "replicated, so each must serve the same number of ranks"
                )
            local_kv = 1
            first_kv = rank // (size // num_kv_heads)
        local_q = num_heads // size
        return cls(
            num_heads=local_q,
            num_kv_heads=local_kv,
            q_rows=Shard(rank * local_q * head_size, local_q * head_size, num_heads * head_size),
            kv_rows=Shard(first_kv * head_size, local_kv * head_size, num_kv_heads * head_size),
        )
