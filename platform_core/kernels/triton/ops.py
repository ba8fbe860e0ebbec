"""The shared Triton kernels behind the ``AttentionOps`` interface.

A GPU backend builds :class:`TritonAttentionOps` with its own :class:`LaunchParams`; it may
subclass it to replace one kernel (e.g. XPU's IPEX path) and keep the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import reference_kv_cache_shape
from platform_core.kernels.triton.launch import LaunchParams
from platform_core.kernels.triton.paged_attention import paged_attention
from platform_core.kernels.triton.write_kv import write_kv
from platform_core.plugins.interfaces import AttentionOps


class TritonAttentionOps(AttentionOps):
    """Paged attention on any device Triton targets, in the canonical cache layout.

    ``num_splits`` forces the split-KV count (``None``: chosen per batch from ``params``); a
    CUDA-graph runner fixes it so that a captured launch stays valid as sequences grow.
    """

    def __init__(self, params: LaunchParams | None = None, num_splits: int | None = None) -> None:
        self.params = params or LaunchParams()
        self.num_splits = num_splits

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
        write_kv(key, value, kv_cache, slot_mapping, self.params.launch_options())

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        q = query if query.dtype == kv_cache.dtype else query.to(kv_cache.dtype)
        out = paged_attention(q, kv_cache, metadata, scale, self.params, self.num_splits)
        return out if out.dtype == query.dtype else out.to(query.dtype)


def triton_op_overrides() -> dict[str, Callable[..., Any]]:
    """The layer ops the shared Triton kernels provide (for ``Backend.op_overrides``)."""
    from platform_core.kernels.triton.lora import triton_lora_expand, triton_lora_shrink
    from platform_core.kernels.triton.quantized_linear import quantized_linear_op
    from platform_core.kernels.triton.token_bitmask import triton_apply_token_bitmask

    return {
        "quantized_linear": quantized_linear_op,
        "apply_token_bitmask": triton_apply_token_bitmask,
        "lora_shrink": triton_lora_shrink,
        "lora_expand": triton_lora_expand,
    }
