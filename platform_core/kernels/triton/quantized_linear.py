"""Triton kernel: a linear on weights kept in GGML blocks (Q8_0, Q4_0, Q4_1), for the GPU backends.

``y[M, N] = x[M, K] @ W.T`` where each row of ``W`` is its 32-weight blocks as stored
(:mod:`platform_core.quantization.formats`). One program computes a ``BLOCK_M x BLOCK_N`` tile of
``y``: for each 32-column block it loads the tile's weight blocks, decodes them in registers (the
float16 scales from their bytes by bit cast, 4-bit weights as two halves of 16, low nibbles then
high, so no interleaving is needed) and accumulates ``x`` times the decoded weights in float32.
The dot runs in the activations' dtype on a GPU (float32 under the interpreter, which computes
``tl.dot`` in float32 only). Steps of more than ``GEMM_ROWS`` rows (prefill) dequantize the
weight and run the vendor's GEMM instead: compute-bound there, the decode kernel's tiles would
lose to it, and one pass over the weight costs little beside the product. FP8_E4M3 rows have
their own kernel (:mod:`.fp8_linear`) behind the same rule; other formats fall back to the
reference op (:func:`quantized_linear_op`).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from platform_core.kernels.triton import triton_interpreting
from platform_core.kernels.triton.fp8_linear import triton_fp8_linear
from platform_core.quantization.formats import FP8_E4M3, QuantFormat, quantized_linear

GEMM_ROWS = 128

logger = logging.getLogger("platform_core.kernels")

# format name -> the kernel's FORMAT constant
KERNEL_FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
# every format with a kernel here (FP8_E4M3's is :mod:`.fp8_linear`)
WITH_KERNELS = frozenset({*KERNEL_FORMATS, FP8_E4M3.name})


@triton.jit
def _half_at(ptr, offsets, mask):
    """The float16 stored little-endian at byte ``offsets``, as float32."""
    low = tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + offsets + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quantized_linear_kernel(
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
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    half = tl.arange(0, 16)
    block_bytes = 34 if FORMAT == 0 else (18 if FORMAT == 1 else 20)
    quant_start = 2 if FORMAT != 2 else 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, K // 32):
        base = cols * row_bytes + block * block_bytes  # [BLOCK_N] byte offsets
        scale = _half_at(w_ptr, base, col_ok)[:, None]
        wmask = col_ok[:, None]
        qs = base[:, None] + quant_start + half[None, :]  # [BLOCK_N, 16]
        if FORMAT == 0:
            first = tl.load(w_ptr + qs, mask=wmask, other=0).to(tl.int8, bitcast=True)
            second = tl.load(w_ptr + qs + 16, mask=wmask, other=0).to(tl.int8, bitcast=True)
            w_first = first.to(tl.float32) * scale
            w_second = second.to(tl.float32) * scale
        else:
            packed = tl.load(w_ptr + qs, mask=wmask, other=0)
            low = (packed & 0x0F).to(tl.float32)
            high = (packed >> 4).to(tl.float32)
            if FORMAT == 1:
                w_first = (low - 8.0) * scale
                w_second = (high - 8.0) * scale
            else:
                offset = _half_at(w_ptr, base + 2, col_ok)[:, None]
                w_first = low * scale + offset
                w_second = high * scale + offset
        xs = rows[:, None] * stride_xm + block * 32 + half[None, :]
        xmask = row_ok[:, None]
        x_first = tl.load(x_ptr + xs, mask=xmask, other=0.0)
        x_second = tl.load(x_ptr + xs + 16, mask=xmask, other=0.0)
        if DOT_FP32:
            acc += tl.dot(x_first.to(tl.float32), tl.trans(w_first))
            acc += tl.dot(x_second.to(tl.float32), tl.trans(w_second))
        else:
            dtype = x_first.dtype
            acc += tl.dot(x_first, tl.trans(w_first.to(dtype)))
            acc += tl.dot(x_second, tl.trans(w_second.to(dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def triton_quantized_linear(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel on ``x [..., K]`` and ``qweight`` in one of :data:`KERNEL_FORMATS`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32
    block_n = 32 if triton_interpreting() else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quantized_linear_kernel[grid](
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
        FORMAT=KERNEL_FORMATS[fmt.name],
        HAS_BIAS=bias is not None,
        DOT_FP32=triton_interpreting() or x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return y.reshape(*x.shape[:-1], n)


_FALLBACK_LOGGED: set[str] = set()


def quantized_linear_op(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
) -> torch.Tensor:
    """The GPU backends' ``quantized_linear``: the kernels for their formats up to ``GEMM_ROWS``
    rows, else the reference (dequantize, then the vendor GEMM); a format without a kernel is
    logged once."""
    rows = x.numel() // x.shape[-1]
    if fmt.name in WITH_KERNELS and qweight.is_contiguous() and rows <= GEMM_ROWS:
        if fmt.name == FP8_E4M3.name:
            return triton_fp8_linear(x, qweight, bias)
        return triton_quantized_linear(x, qweight, fmt, bias)
    if fmt.name in WITH_KERNELS:
        return quantized_linear(x, qweight, fmt, bias)
    if fmt.name not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(fmt.name)
        logger.warning(
            "quantized linear: no Triton kernel for %s yet; it runs the reference op "
            "(dequantizes on every call)",
            fmt.name,
        )
    return quantized_linear(x, qweight, fmt, bias)


quantized_linear_op.kernel_formats = WITH_KERNELS  # read by has_kernel
