"""Sizing and allocating the per-layer KV-cache tensors of a model in a backend's layout."""

from __future__ import annotations

import math
import mmap
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
    if device.type == "cpu":
        return [zeroed_host_tensor(shape, dtype) for _ in range(model.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory that costs nothing until used.

    The memory is an anonymous mapping: the OS hands out zeroed pages on first touch, so a
    large cache is not written once up front (``torch.zeros`` of 4 GiB takes seconds), and
    pages no sequence reaches are never committed. Transparent huge pages are requested for
    it (fewer TLB misses when attention reads scattered blocks).
    """
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
