"""The CPU backend's ``quantized_linear``: the compiled kernel on GGML blocks as stored.

Decode-sized steps round the activations to 8 bits per 32 values (16 for Q8_0) and take integer
dot products with the weights' blocks (VNNI on the ``avx512_bf16`` build, AVX2's multiply-adds
below it), so a step reads the blocks' bytes, not a dequantized copy. Larger steps dequantize:
on AVX512-BF16 builds with bf16 activations a panel of weight rows at a time into bf16 dot
products, elsewhere chunks of rows into torch's fp32 matmul (``csrc/quantized_linear.cpp``
says where the line is and why).
Inputs the kernel does not take (other dtypes, formats without a kernel: FP8_E4M3, whose layers
the loader then logs as running the reference op) go to the core's reference op, which
dequantizes on every call.
"""

from __future__ import annotations

from typing import Any

import torch

from platform_core.backend_api import QuantFormat, QuantizedLinearFn, quantized_linear

KERNEL_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def compiled_quantized_linear(ops: Any) -> QuantizedLinearFn:
    """``quantized_linear`` over the compiled ``ops`` namespace (a kernel build's
    ``torch.ops.platform_core_cpu_<level>``)."""

    def cpu_quantized_linear(
        x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if (
            fmt.name not in KERNEL_FORMATS
            or x.dtype not in KERNEL_DTYPES
            or qweight.dtype != torch.uint8
            or (bias is not None and bias.dtype != x.dtype)
        ):
            return quantized_linear(x, qweight, fmt, bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = ops.quantized_linear(rows, qweight.contiguous(), fmt.name, bias)
        return out.view(*x.shape[:-1], qweight.shape[0])

    cpu_quantized_linear.kernel_formats = KERNEL_FORMATS  # read by the core's has_kernel
    return cpu_quantized_linear
