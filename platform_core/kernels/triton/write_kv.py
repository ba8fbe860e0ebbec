"""Triton kernel: scatter this step's keys and values into the paged cache.

One program per token writes all its KV heads; a slot of ``-1`` (padding) writes nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from platform_core.kernels.triton.launch import next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_b,
    stride_cache_t,
    stride_cache_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_SIZE)
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    dst = block * stride_cache_b + offset * stride_cache_t + heads * stride_cache_h + dims
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def write_kv_constants(block_size: int, num_kv_heads: int, head_size: int) -> dict[str, int]:
    """The compile-time arguments of :func:`_write_kv_kernel`."""
    return dict(
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    launch_options: dict[str, Any] | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at their slots.

    ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (any strides with a
    contiguous last dim); values are converted to its dtype. ``-1`` slots are skipped.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        **write_kv_constants(k_cache.shape[1], num_kv_heads, head_size),
        **(launch_options or {}),
    )
