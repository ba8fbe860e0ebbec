"""Triton kernels: LoRA shrink and expand (multi-LoRA serving), for the GPU backends.

Each program takes ``BLOCK_T`` consecutive tokens and reads their slots from ``token_slots``.
It visits the distinct slots among them, highest first (one visit in a prefill block, where all
tokens share a request; a few in a decode block), and for each runs ``tl.dot`` on that slot's
adapter tile with the other tokens' rows masked to zero, accumulating in float32. Tokens of
slot -1 get zeros (shrink) or are left untouched (expand). Shrink's grid is token blocks x
parts; expand's is token blocks x column blocks of the widest part x parts, each part's columns
found from a small table of part offsets. The dot runs in the activations' dtype on a GPU
(float32, without TF32 rounding, for float32 models and under the interpreter, which computes
``tl.dot`` in float32 only). Shapes are the caller's to get right, as for the other kernels
(the reference ops check them: :func:`platform_core.layers.lora.check_lora_shrink_args`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from platform_core.kernels.triton import triton_interpreting

if TYPE_CHECKING:  # the kernels sit beside the layers, not above them
    from platform_core.layers.lora_mapping import LoRAMapping

BLOCK_T = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    buffer_ptr,
    T,
    K,
    R,
    stride_xt,
    stride_al,
    stride_as,
    stride_ar,
    stride_bs,
    stride_bt,
    DOT_FP32: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    part = tl.program_id(1)
    token_ok = tokens < T
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=-1)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    slot = tl.max(slots, axis=0)
    while slot >= 0:
        mine = slots == slot
        a_base = a_ptr + slot.to(tl.int64) * stride_al + part * stride_as
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x_at = x_ptr + tokens[:, None].to(tl.int64) * stride_xt + k[None, :]
            x = tl.load(x_at, mask=mine[:, None] & k_ok[None, :], other=0.0)
            a_at = a_base + ranks[None, :] * stride_ar + k[:, None]  # [BLOCK_K, BLOCK_R]
            a = tl.load(a_at, mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        slot = tl.max(tl.where(slots < slot, slots, -1), axis=0)
    out_at = buffer_ptr + part * stride_bs + tokens[:, None].to(tl.int64) * stride_bt
    tl.store(out_at + ranks[None, :], acc, mask=token_ok[:, None] & rank_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    out_ptr,
    buffer_ptr,
    b_ptr,
    slots_ptr,
    offsets_ptr,
    T,
    R,
    stride_ot,
    stride_bs,
    stride_bt,
    stride_bl,
    stride_bn,
    DOT_FP32: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    part = tl.program_id(2)
    start = tl.load(offsets_ptr + part)
    size = tl.load(offsets_ptr + part + 1) - start
    within = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = within < size
    cols = start + within
    token_ok = tokens < T
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=-1)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    slot = tl.max(slots, axis=0)
    while slot >= 0:
        mine = slots == slot
        buf_at = buffer_ptr + part * stride_bs + tokens[:, None].to(tl.int64) * stride_bt
        buf = tl.load(buf_at + ranks[None, :], mask=mine[:, None] & rank_ok[None, :], other=0.0)
        b_at = b_ptr + slot.to(tl.int64) * stride_bl + cols[None, :] * stride_bn + ranks[:, None]
        b = tl.load(b_at, mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(buf, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(buf.to(b.dtype), b)
        slot = tl.max(tl.where(slots < slot, slots, -1), axis=0)
    keep = (token_ok & (slots >= 0))[:, None] & col_ok[None, :]
    out_at = out_ptr + tokens[:, None].to(tl.int64) * stride_ot + cols[None, :]
    current = tl.load(out_at, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_at, (current + acc).to(out_ptr.dtype.element_ty), mask=keep)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


@functools.lru_cache(maxsize=64)
def _part_offsets(slice_sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[0, n_0, n_0 + n_1, ...]`` as int32 on ``device``, made once per layout."""
    offsets = [0]
    for size in slice_sizes:
        offsets.append(offsets[-1] + size)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def triton_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """The GPU backends' ``lora_shrink`` (:data:`platform_core.layers.lora.LoRAShrinkFn`)."""
    tokens, inputs = x.shape
    parts, rank = lora_a.shape[1], lora_a.shape[2]
    if not mapping.has_adapters or tokens == 0:
        return torch.zeros(parts, tokens, rank, dtype=torch.float32, device=x.device)
    x = _rows_contiguous(x)
    lora_a = _rows_contiguous(lora_a)
    buffer = torch.empty(parts, tokens, rank, dtype=torch.float32, device=x.device)
    interpret = triton_interpreting()
    grid = (triton.cdiv(tokens, BLOCK_T), parts)
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        mapping.token_slots.to(x.device, non_blocking=True),
        buffer,
        tokens,
        inputs,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        buffer.stride(0),
        buffer.stride(1),
        DOT_FP32=interpret or x.dtype == torch.float32,
        BLOCK_T=BLOCK_T,
        BLOCK_K=32 if interpret else 64,
        BLOCK_R=_block_r(rank),
    )
    return buffer


def triton_lora_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
) -> None:
    """The GPU backends' ``lora_expand`` (:data:`platform_core.layers.lora.LoRAExpandFn`)."""
    tokens, rank = out.shape[0], buffer.shape[2]
    if not mapping.has_adapters or tokens == 0:
        return
    if out.stride(-1) != 1:  # the kernel writes rows of contiguous columns
        staged = out.contiguous()
        triton_lora_expand(staged, buffer, lora_b, slice_sizes, mapping)
        out.copy_(staged)
        return
    buffer = _rows_contiguous(buffer.float())
    lora_b = _rows_contiguous(lora_b)
    interpret = triton_interpreting()
    block_n = 32 if interpret else 64
    grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(max(slice_sizes), block_n), len(slice_sizes))
    _lora_expand_kernel[grid](
        out,
        buffer,
        lora_b,
        mapping.token_slots.to(out.device, non_blocking=True),
        _part_offsets(tuple(slice_sizes), out.device),
        tokens,
        rank,
        out.stride(0),
        buffer.stride(0),
        buffer.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        DOT_FP32=interpret or out.dtype == torch.float32,
        BLOCK_T=BLOCK_T,
        BLOCK_N=block_n,
        BLOCK_R=_block_r(rank),
    )
