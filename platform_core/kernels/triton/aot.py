"""Ahead-of-time compilation of the kernels for a named GPU without that GPU being present.

Triton compiles to PTX/cubin and AMDGCN/hsaco on any machine, so CPU CI catches what the
interpreter cannot (code the compiler rejects) and checks each variant's shared memory against
the target's limit. Backends can use it to vet their launch parameters for new hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from platform_core.kernels.triton import fp8_linear, paged_attention, split_kv, write_kv
from platform_core.kernels.triton.launch import AttentionPlan, LaunchParams

TARGETS = {
    "sm_80": GPUTarget("cuda", 80, 32),
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
}
SHARED_MEMORY_LIMITS = {"sm_80": 163 << 10, "sm_90": 227 << 10, "gfx942": 64 << 10}
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    """What one compiled variant needs on its target."""

    kernel: str
    target: str
    shared_bytes: int

    @property
    def fits(self) -> bool:
        """Whether its shared memory (LDS on AMD) fits the target."""
        return self.shared_bytes <= SHARED_MEMORY_LIMITS[self.target]


def _compile(
    kernel: Any,
    types: dict[str, str],
    constants: dict[str, Any],
    target: str,
    params: LaunchParams,
) -> CompiledKernel:
    """Compile ``kernel``; arguments not in ``types`` or ``constants`` are 32-bit ints."""
    signature = {
        name: "constexpr" if name in constants else types.get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(kernel, signature, constants)
    compiled = triton.compile(source, target=TARGETS[target], options=params.launch_options())
    return CompiledKernel(kernel.__name__, target, compiled.metadata.shared)


def compile_attention(
    target: str,
    dtype: torch.dtype,
    plan: AttentionPlan,
    head_size: int,
    group: int,
    block_size: int,
    params: LaunchParams,
) -> CompiledKernel:
    """Compile the paged-attention kernel as :func:`paged_attention` would launch it."""
    data = "*" + _TYPE_NAMES[dtype]
    out = "*fp32" if plan.num_splits > 1 else data
    types = {"out_ptr": out, "lse_ptr": "*fp32", "q_ptr": data, "k_cache_ptr": data,
             "v_cache_ptr": data, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "query_start_loc_ptr": "*i32", "scale_log2": "fp32"}  # fmt: skip
    constants = paged_attention.attention_constants(plan, head_size, group, block_size)
    return _compile(paged_attention._paged_attention_kernel, types, constants, target, params)


def compile_write_kv(
    target: str,
    dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    params: LaunchParams,
) -> CompiledKernel:
    """Compile the KV-write kernel."""
    data = "*" + _TYPE_NAMES[dtype]
    types = {"key_ptr": data, "value_ptr": data, "k_cache_ptr": data, "v_cache_ptr": data,
             "slot_mapping_ptr": "*i64"}  # fmt: skip
    constants = write_kv.write_kv_constants(block_size, num_kv_heads, head_size)
    return _compile(write_kv._write_kv_kernel, types, constants, target, params)


def compile_combine(
    target: str,
    dtype: torch.dtype,
    num_splits: int,
    head_size: int,
    head_pad: int,
    params: LaunchParams,
) -> CompiledKernel:
    """Compile the split-KV combine kernel writing ``dtype`` outputs."""
    types = {"out_ptr": "*" + _TYPE_NAMES[dtype], "partial_ptr": "*fp32", "lse_ptr": "*fp32"}
    constants = split_kv.combine_constants(num_splits, head_size, head_pad)
    return _compile(split_kv._combine_kernel, types, constants, target, params)


def compile_fp8_linear(
    target: str, dtype: torch.dtype, rows: int, params: LaunchParams
) -> CompiledKernel:
    """Compile the FP8 linear kernel as it is launched for ``rows`` rows of ``dtype``."""
    data = "*" + _TYPE_NAMES[dtype]
    types = {"x_ptr": data, "w_ptr": "*u8", "bias_ptr": data, "y_ptr": data}
    constants = fp8_linear.fp8_linear_constants(rows, dtype, has_bias=True, interpret=False)
    return _compile(fp8_linear._fp8_linear_kernel, types, constants, target, params)
