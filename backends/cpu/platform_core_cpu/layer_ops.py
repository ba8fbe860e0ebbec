"""Fused RMS norm, SiLU-and-multiply and rotary, and a vectorized row argmax and token bitmask
for the sampler, from the compiled kernels, as op overrides.

Each fused op reads its input once instead of running a chain of torch ops (four to six passes
and temporaries each); results round where the unfused ops round. Inputs the kernels do not take
(other dtypes, layouts without contiguous rows) go to the core's default op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from platform_core.backend_api import (
    apply_rotary,
    apply_token_bitmask,
    rms_norm,
    row_argmax,
    silu_and_mul,
)

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype in FUSED_DTYPES and x.dim() == 2 and x.stride(1) == 1


def fused_layer_ops(ops: Any) -> dict[str, Callable[..., Any]]:
    """``rms_norm``, ``silu_and_mul``, ``rotary``, ``argmax`` and ``apply_token_bitmask``
    overrides over the compiled ``ops`` namespace (a kernel build's
    ``torch.ops.platform_core_cpu_<level>``)."""

    def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype != x.dtype:
            return rms_norm(x, weight, eps)
        if _rows_ok(x):
            return ops.rms_norm(x, weight, eps)
        if x.dim() == 3 and x.dtype in FUSED_DTYPES:  # per-head q/k norms
            return ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return rms_norm(x, weight, eps)

    def fused_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x) if _rows_ok(x) else silu_and_mul(x)

    def fused_rotary(
        query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = query.dtype
        fusable = (
            dtype in FUSED_DTYPES
            and key.dtype == cos.dtype == sin.dtype == dtype
            and query.stride(-1) == key.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
        )
        if not fusable:
            return apply_rotary(query, key, cos, sin)
        ops.rotary(query, key, cos, sin)
        return query, key

    def compiled_argmax(x: torch.Tensor) -> torch.Tensor:
        if _rows_ok(x) and x.shape[1] > 0:
            return ops.argmax_rows(x)
        return row_argmax(x)

    def compiled_token_bitmask(
        logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
    ) -> None:
        takes = (
            logits.dtype == torch.float32
            and logits.dim() == bitmask.dim() == 2
            and logits.stride(1) == bitmask.stride(1) == 1
            and bitmask.dtype == torch.int32
            and rows.dtype == torch.int64
        )
        if takes:
            ops.apply_token_bitmask(logits, bitmask, rows.contiguous())
        else:
            apply_token_bitmask(logits, bitmask, rows)

    return {
        "rms_norm": fused_rms_norm,
        "silu_and_mul": fused_silu_and_mul,
        "rotary": fused_rotary,
        "argmax": compiled_argmax,
        "apply_token_bitmask": compiled_token_bitmask,
    }
