"""Sizing and allocating the per-layer KV-cache tensors of a model in a backend's layout."""

from __future__ import annotations

from typing import Any

import torch

from platform_core.plugins.interfaces import AttentionOps


def kv_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of ``block_size`` tokens takes across all of ``model``'s layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * model.num_kv_heads * model.head_size * element * model.num_layers


def allocate_kv_caches(
    ops: AttentionOps,
    model: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer (zeros: unwritten slots are never NaN)."""
    shape = ops.kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
