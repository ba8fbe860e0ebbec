"""Sizing and allocating the per-layer KV-cache tensors of a model in a backend's layout."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import torch

from platform_core.plugins.interfaces import AttentionOps


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """One rank's KV cache as allocated: ``num_blocks`` blocks of ``block_size`` tokens.

    ``bytes_per_block`` is what the cache was planned at per block (all layers);
    ``allocated_bytes`` what its tensors take in the backend's layout (at most
    ``planned_bytes``); ``devices`` the distinct devices they live on.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    allocated_bytes: int
    devices: tuple[torch.device, ...]

    @property
    def planned_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


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


_HUGE_PAGE = 2 << 20


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory, on huge pages where the OS grants them.

    The memory is an anonymous mapping with transparent huge pages requested: the OS hands
    out zeroed pages, so the cache is never filled by us (``torch.zeros`` of 4 GiB takes
    seconds in 4 KiB page faults), and huge pages mean fewer TLB misses when attention reads
    scattered blocks.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size())
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # One write per huge page commits the memory now (the OS zeroes whole 2 MiB pages, far
    # faster than filling 4 KiB ones) instead of in page faults while serving.
    torch.frombuffer(buffer, dtype=torch.uint8)[::_HUGE_PAGE].zero_()
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
