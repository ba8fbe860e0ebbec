"""The shared Triton kernels compiled ahead of time for NVIDIA sm_80/sm_90 and AMD gfx942 with the
cuda and rocm backends' launch parameters (the FP8 linear at a decode's and the largest kernel
batch's rows, in each activation dtype).

The interpreter (``test_triton_kernels.py``) runs Python, so only the compiler catches code it
rejects, and shared memory is checked against each target's limit. The compile runs in a child
process (this file run as a script) without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
from json_child import collect, start_child

from platform_core.kernels.triton import triton_installed
from platform_core.kernels.triton.launch import LaunchParams, plan_attention


@dataclass(frozen=True)
class AotVariant:
    """A batch shape compiled for ``target`` with ``backend``'s launch parameters."""

    target: str
    backend: str
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str


AOT_VARIANTS = {
    "sm90_prefill_fp16_gqa4_head128": AotVariant("sm_90", "cuda", 64, 512, 4096, 32, 8, 128, 16,
                                                 "float16"),
    "sm90_decode_split_bf16_group3_head64": AotVariant("sm_90", "cuda", 4, 1, 8192, 9, 3, 64, 16,
                                                       "bfloat16"),
    "sm80_prefill_bf16_group8_head256_block64": AotVariant("sm_80", "cuda", 64, 256, 2048, 64, 8,
                                                           256, 64, "bfloat16"),
    "sm80_decode_fp32_mha_head128_block32": AotVariant("sm_80", "cuda", 8, 1, 4096, 16, 16, 128,
                                                       32, "float32"),
    "gfx942_prefill_fp16_gqa4_head128": AotVariant("gfx942", "rocm", 64, 512, 4096, 32, 8, 128,
                                                   16, "float16"),
    "gfx942_decode_split_bf16_head96": AotVariant("gfx942", "rocm", 4, 1, 8192, 32, 8, 96, 32,
                                                  "bfloat16"),
}  # fmt: skip
FP8_TARGETS = {"sm_80": "cuda", "sm_90": "cuda", "gfx942": "rocm"}


def compile_variant(variant: AotVariant, params: LaunchParams) -> dict:
    """Compile the kernels one batch of ``variant`` launches; their shared memory and fit."""
    from platform_core.kernels.triton import aot

    dtype = getattr(torch, variant.dtype)
    plan = plan_attention(
        num_seqs=variant.num_seqs,
        max_query_len=variant.max_query_len,
        max_seq_len=variant.max_seq_len,
        num_heads=variant.num_heads,
        num_kv_heads=variant.num_kv_heads,
        head_size=variant.head_size,
        dtype=dtype,
        params=params,
        interpret=False,
    )
    group = variant.num_heads // variant.num_kv_heads
    compiled = [
        aot.compile_attention(
            variant.target, dtype, plan, variant.head_size, group, variant.block_size, params
        ),
        aot.compile_write_kv(
            variant.target,
            dtype,
            variant.block_size,
            variant.num_kv_heads,
            variant.head_size,
            params,
        ),
    ]
    if plan.num_splits > 1:
        compiled.append(
            aot.compile_combine(
                variant.target, dtype, plan.num_splits, variant.head_size, plan.head_pad, params
            )
        )
    return {
        "num_splits": plan.num_splits,
        "shared": {c.kernel: c.shared_bytes for c in compiled},
        "fits": all(c.fits for c in compiled),
    }


def _child_main() -> None:
    try:
        from platform_core_cuda.plugin import cuda_launch_params
        from platform_core_rocm.plugin import rocm_launch_params
    except ImportError as exc:
        print(json.dumps({"skipped": f"the cuda and rocm backends are not installed: {exc}"}))
        return
    from platform_core.kernels.triton import aot

    params = {"cuda": cuda_launch_params(num_sms=132), "rocm": rocm_launch_params(304)}
    results = {}
    for name, variant in AOT_VARIANTS.items():
        try:
            results[name] = compile_variant(variant, params[variant.backend])
        except Exception as exc:  # reported per variant, asserted by the test
            results[name] = {"error": repr(exc)[-3000:]}
    for target, backend in FP8_TARGETS.items():
        for dtype in ("bfloat16", "float16", "float32"):
            for rows in (1, 128):
                name = f"fp8_linear_{target}_{dtype}_m{rows}"
                try:
                    compiled = aot.compile_fp8_linear(
                        target, getattr(torch, dtype), rows, params[backend]
                    )
                    results[name] = {"fits": compiled.fits}
                except Exception as exc:  # reported per variant, asserted by the test
                    results[name] = {"error": repr(exc)[-3000:]}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def aot_results() -> dict:
    if not triton_installed():
        pytest.skip("triton is not installed (pip install triton==3.7.1)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = collect(start_child(__file__, "aot", env), "compile")
    if "skipped" in results:
        pytest.skip(results["skipped"])
    return results


@pytest.mark.parametrize("name", list(AOT_VARIANTS))
def test_kernels_compile_for_each_backend_target(aot_results: dict, name: str) -> None:
    result = aot_results[name]
    assert "error" not in result, result.get("error")
    assert result["fits"], f"{name} needs more shared memory than the target has: {result}"


def test_the_fp8_linear_kernel_compiles_for_each_target(aot_results: dict) -> None:
    compiled = {k: v for k, v in aot_results.items() if k.startswith("fp8_linear_")}
    assert len(compiled) == len(FP8_TARGETS) * 3 * 2
    for name, result in compiled.items():
        assert "error" not in result, (name, result.get("error"))
        assert result["fits"], name


def test_aot_variants_cover_the_split_path(aot_results: dict) -> None:
    assert aot_results["sm90_decode_split_bf16_group3_head64"]["num_splits"] > 1
    assert "_combine_kernel" in aot_results["gfx942_decode_split_bf16_head96"]["shared"]


if __name__ == "__main__":
    _child_main()
