"""Triton kernel: combine the per-split partial outputs of split-KV attention.

Each split wrote its output normalised by its own softmax sum and the base-2 log-sum-exp of its
scores; weighting the splits by ``2 ** (lse - max lse)`` gives the softmax over all keys. An empty
split (LSE ``-inf``) weighs nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from platform_core.kernels.triton.launch import next_power_of_2


@triton.jit
def _combine_kernel(
    out_ptr,
    partial_ptr,
    lse_ptr,
    stride_out_t,
    stride_out_h,
    stride_part_t,
    stride_part_h,
    stride_part_s,
    stride_lse_t,
    stride_lse_h,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(
        lse_ptr + token * stride_lse_t + head * stride_lse_h + splits,
        mask=split_ok,
        other=float("-inf"),
    )
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = weight / tl.sum(weight, 0)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    part_offs = token * stride_part_t + head * stride_part_h + splits[:, None] * stride_part_s
    part = tl.load(
        partial_ptr + part_offs + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0)
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + dims, out, mask=dim_ok)


def combine_constants(num_splits: int, head_size: int, head_pad: int) -> dict[str, int]:
    """The compile-time arguments of :func:`_combine_kernel`."""
    return dict(
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
    )


def combine_splits(
    partial: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    launch_options: dict[str, Any] | None = None,
) -> None:
    """Write into ``out`` ``[tokens, heads, head_size]`` the softmax-weighted sum of
    ``partial`` ``[tokens, heads, splits, >= head_size]`` by the base-2 ``lse``
    ``[tokens, heads, splits]``."""
    num_tokens, num_heads, num_splits, head_pad = partial.shape
    _combine_kernel[(num_tokens, num_heads)](
        out,
        partial,
        lse,
        out.stride(0),
        out.stride(1),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        **combine_constants(num_splits, out.shape[2], head_pad),
        **(launch_options or {}),
    )
