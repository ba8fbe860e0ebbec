"""Triton kernel: a linear on FP8_E4M3 weights (a float32 scale per output row), for the GPU
backends.

``y[M, N] = x[M, K] @ W.T`` where row ``n`` of ``W`` is its scale ``s[n]`` then ``K`` float8 e4m3
codes (:mod:`platform_core.quantization.formats`). The scale is per output row, so it factors out
of the row's dot product: one program computes a ``BLOCK_M x BLOCK_N`` tile of ``x @ Q.T`` over
``BLOCK_K`` columns at a time (codes loaded as bytes and widened in registers), then multiplies
each output column by its row's scale once. The codes are widened without a float8 type: the
e4m3 sign, exponent and mantissa bits moved into a float16's (times 2^8, the difference of the
exponent biases) give every finite e4m3 value exactly, subnormals included, on any target Triton
has (ROCm's MI300 float8 is the other e4m3 variant, so a native float8 cast would not do there).
NaN codes, which quantizing never makes, would read as 480. Every e4m3 value is exact in
float16 and bfloat16, so the dot runs in the activations' dtype on a GPU (float32 under the
interpreter, which computes ``tl.dot`` in float32 only).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from platform_core.kernels.triton import triton_interpreting


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    row_bytes,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k_ok = start + ks < K
        codes = tl.load(
            w_ptr + cols[:, None] * row_bytes + 4 + start + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0,
        ).to(tl.uint16)
        bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
        w = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # [BLOCK_N, BLOCK_K]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + start + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    scale_bytes = w_ptr + cols * row_bytes
    scale_bits = tl.load(scale_bytes, mask=col_ok, other=0).to(tl.uint32)
    for i in tl.static_range(1, 4):
        scale_bits |= tl.load(scale_bytes + i, mask=col_ok, other=0).to(tl.uint32) << (8 * i)
    acc *= scale_bits.to(tl.float32, bitcast=True)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear_constants(
    rows: int, dtype: torch.dtype, has_bias: bool, interpret: bool
) -> dict[str, Any]:
    """The kernel's compile-time constants for ``rows`` rows of ``dtype`` activations."""
    return {
        "HAS_BIAS": has_bias,
        "DOT_FP32": interpret or dtype == torch.float32,
        "BLOCK_M": 16 if rows <= 16 else 32,
        "BLOCK_N": 32 if interpret else 64,
        "BLOCK_K": 64,
    }


def triton_fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel on ``x [..., K]`` and FP8_E4M3 rows ``qweight`` (``uint8 [N, 4 + K]``)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    constants = fp8_linear_constants(m, x.dtype, bias is not None, triton_interpreting())
    grid = (triton.cdiv(m, constants["BLOCK_M"]), triton.cdiv(n, constants["BLOCK_N"]))
    _fp8_linear_kernel[grid](
        rows,
        qweight,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        rows.stride(0),
        y.stride(0),
        qweight.stride(0),
        **constants,
    )
    return y.reshape(*x.shape[:-1], n)
