"""Triton kernel: causal attention of a flattened mixed batch over the paged KV cache.

Prefill chunks and decodes share one kernel. A program takes ``BLOCK_Q`` query tokens of one
sequence times the ``GROUP`` query heads that read the same KV head (grouped-query attention
turns into one ``[BLOCK_M, HEAD]`` tile), walks that sequence's keys ``BLOCK_N`` at a time through
its block table, and keeps an online softmax in float32. A query at position ``p`` sees keys
``0..p``: the cached prefix and the chunk's own earlier tokens.

Split-KV (flash-decoding): with ``NUM_SPLITS > 1`` each program covers one range of the keys
and writes its normalised partial output and base-2 log-sum-exp; :mod:`.split_kv` combines them.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from platform_core.attention.metadata import AttentionMetadata
from platform_core.kernels.triton import triton_interpreting
from platform_core.kernels.triton.launch import AttentionPlan, LaunchParams, plan_attention
from platform_core.kernels.triton.split_kv import combine_splits

_LOG2E = 1.4426950408889634
# Read once, as triton.jit does when it decorates the kernels below.
_INTERPRETED = triton_interpreting()


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_out_s,
    stride_lse_t,
    stride_lse_h,
    stride_cache_b,
    stride_cache_t,
    stride_cache_h,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q_offs = (q_start + tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok

    # Keys this tile may see, cut into whole BLOCK_N steps shared out between the splits.
    kv_end = tl.minimum(seq_len, prefix + tl.minimum((q_tile + 1) * BLOCK_Q, q_len))
    num_steps = tl.cdiv(kv_end, BLOCK_N)
    steps_per_split = tl.cdiv(num_steps, NUM_SPLITS)
    step_lo = split * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, num_steps)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table
    for step in range(step_lo, step_hi):
        kv_pos = step * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_offs = block * stride_cache_b + (kv_pos % BLOCK_SIZE) * stride_cache_t
        kv_offs = kv_offs[:, None] + kv_head * stride_cache_h + dims[None, :]
        kv_mask = kv_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0  # false only for split ranges a row cannot see
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_offs = (
        (q_start + tok)[:, None] * stride_out_t
        + head[:, None] * stride_out_h
        + split * stride_out_s
        + dims[None, :]
    )
    tl.store(out_ptr + out_offs, out, mask=row_ok[:, None] & dim_ok[None, :])
    if NUM_SPLITS > 1:
        # Base-2 log-sum-exp of this split's (log2-scaled) scores; -inf marks an empty split.
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        lse_offs = (q_start + tok) * stride_lse_t + head * stride_lse_h + split
        tl.store(lse_ptr + lse_offs, lse, mask=row_ok)


def attention_constants(
    plan: AttentionPlan, head_size: int, group: int, block_size: int
) -> dict[str, Any]:
    """The compile-time arguments of :func:`_paged_attention_kernel` for one launch."""
    return dict(
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEAD_PAD=plan.head_pad,
        GROUP=group,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        NUM_SPLITS=plan.num_splits,
        UPCAST=plan.upcast,
        DOT_PRECISION=plan.dot_precision,
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    params: LaunchParams,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``query`` ``[num_tokens, num_heads, head_size]`` over the cache.

    ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]`` in the query's
    dtype. Every query row must belong to a sequence of ``metadata``. Returns a new tensor
    like ``query``.
    """
    num_tokens, num_heads, head_size = query.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[2]
    plan = plan_attention(
        num_seqs=metadata.num_seqs,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=query.dtype,
        params=params,
        interpret=_INTERPRETED,
        num_splits=num_splits,
    )
    query = query if query.stride(-1) == 1 else query.contiguous()
    tables = metadata.block_tables
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0 or metadata.num_seqs == 0:
        return out
    if plan.num_splits == 1:
        target, lse = out, out  # the kernel writes the final output; no LSE
    else:
        # fp32 partial outputs [tokens, heads, splits, HEAD_PAD] and their LSE [.., splits]
        target = query.new_empty(
            (num_tokens, num_heads, plan.num_splits, plan.head_pad), dtype=torch.float32
        )
        lse = query.new_empty((num_tokens, num_heads, plan.num_splits), dtype=torch.float32)
    split_stride = target.stride(2) if plan.num_splits > 1 else 0
    _paged_attention_kernel[plan.grid(metadata.num_seqs, num_kv_heads)](
        target,
        lse,
        query,
        k_cache,
        v_cache,
        tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        split_stride,
        lse.stride(0),
        lse.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        **attention_constants(plan, head_size, num_heads // num_kv_heads, k_cache.shape[1]),
        **params.launch_options(),
    )
    if plan.num_splits > 1:
        combine_splits(target, lse, out, params.launch_options())
    return out
