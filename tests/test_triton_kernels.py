"""The shared Triton paged-attention kernels against the pure-torch reference, and compiled.

Triton must see ``TRITON_INTERPRET=1`` before the kernels are decorated, so the kernel cases run
in a child process (this file run as a script) with the variable set; the child reports one JSON
line and the tests here assert on it. ``PLATFORM_CORE_KERNEL_DEVICE=cuda`` runs the same cases
compiled on a real GPU instead (``benchmarks/gpu_check.sh``).

Each case scatters fresh K/V into a cache full of random stale data with the kernel and with the
reference (the caches must match exactly), then compares attention. A second child compiles the
kernels ahead of time for NVIDIA sm_80/sm_90 and AMD gfx942 with the cuda and rocm backends'
launch parameters: the interpreter runs Python, so only the compiler catches code it rejects, and
shared memory is checked against each target's limit. The launch-planning rules are plain Python
and tested in ``test_triton_launch_plan.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from platform_core.kernels.triton import triton_installed
from platform_core.kernels.triton.launch import LaunchParams, plan_attention

DEVICE_ENV = "PLATFORM_CORE_KERNEL_DEVICE"
CHILD_TIMEOUT_S = 300
SMALL_TILES = LaunchParams(block_m=16, block_n=16)  # few programs and steps: fast interpreting


@dataclass(frozen=True)
class Case:
    """One kernel check: a batch of ``(query_len, seq_len)`` sequences and the launch knobs."""

    seqs: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    atol: float
    num_splits: int | None = None
    params: LaunchParams = SMALL_TILES


CASES = {
    # Prefill chunk over a cached prefix, a fresh prefill, decodes at and across block edges.
    "mixed_gqa4_fp32_block16_head64": Case(
        seqs=((12, 40), (1, 33), (20, 20), (1, 16), (1, 17)),
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype="float32",
        atol=2e-5,
        params=LaunchParams(block_m=16, block_n=32),  # each key step spans two KV blocks
    ),
    # bf16 (dot products upcast to fp32 in the interpreter), multi-query attention.
    "mixed_mqa_bf16_block32_head128": Case(
        seqs=((9, 45), (1, 64), (1, 65)),
        num_heads=4,
        num_kv_heads=1,
        head_size=128,
        block_size=32,
        dtype="bfloat16",
        atol=2e-2,
        params=LaunchParams(block_m=16, block_n=64),
    ),
    # bf16 through the split-KV path, eight query heads per KV head.
    "decode_split2_bf16_group8_head64": Case(
        seqs=((1, 100), (1, 47)),
        num_heads=8,
        num_kv_heads=1,
        head_size=64,
        block_size=16,
        dtype="bfloat16",
        atol=2e-2,
        num_splits=2,
    ),
    # Long decodes through the split-KV path (forced), fp16, wide heads, KV blocks of 64.
    "decode_split4_fp16_block64_head256": Case(
        seqs=((1, 300), (1, 129), (1, 64)),
        num_heads=2,
        num_kv_heads=1,
        head_size=256,
        block_size=64,
        dtype="float16",
        atol=2e-3,
        num_splits=4,
    ),
    # Split-KV chosen by the planner for a prefill chunk plus a decode; a group of 3 query
    # heads per KV head (SmolLM2's 9/3) and a head size that is not a power of two.
    "mixed_auto_split_group3_fp32_head96": Case(
        seqs=((6, 70), (1, 90)),
        num_heads=6,
        num_kv_heads=2,
        head_size=96,
        block_size=16,
        dtype="float32",
        atol=2e-5,
        params=LaunchParams(block_m=16, block_n=16, target_programs=64, split_min_tokens=16),
    ),
}


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


def build_batch(case: Case, seed: int = 0):
    """Query, new K/V, a cache of random stale data and the metadata of ``case``'s batch, on
    the CPU. Block ids are a random permutation: sequences own scattered, interleaved blocks."""
    from platform_core.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    bs = case.block_size
    blocks_per_seq = [-(-seq_len // bs) for _, seq_len in case.seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros((len(case.seqs), max(blocks_per_seq)), dtype=torch.int32)
    slots, starts, used = [], [0], 0
    for i, ((q_len, seq_len), n) in enumerate(zip(case.seqs, blocks_per_seq)):
        tables[i, :n] = torch.tensor(perm[used : used + n])
        used += n
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    num_tokens = starts[-1]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(dtype)

    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in case.seqs], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(q for q, _ in case.seqs),
        max_seq_len=max(s for _, s in case.seqs),
        block_size=bs,
        query_start_loc_cpu=starts,
        seq_lens_cpu=[s for _, s in case.seqs],
    )
    query = rand(num_tokens, case.num_heads, case.head_size)
    key = rand(num_tokens, case.num_kv_heads, case.head_size)
    value = rand(num_tokens, case.num_kv_heads, case.head_size)
    cache = rand(2, num_blocks, bs, case.num_kv_heads, case.head_size)
    return query, key, value, cache, metadata


def to_device(metadata, device: str):
    """``metadata`` with its tensors on ``device``."""
    from platform_core.attention.metadata import AttentionMetadata

    fields = {name: getattr(metadata, name) for name in AttentionMetadata.__slots__}
    return AttentionMetadata(
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    )


def run_case(case: Case, device: str) -> dict:
    """Kernel (on ``device``) vs. reference (on the CPU) for one case; the measurements."""
    from platform_core.attention.reference import reference_paged_attention, reference_write_kv
    from platform_core.kernels.triton import triton_interpreting
    from platform_core.kernels.triton.ops import TritonAttentionOps

    query, key, value, cache, metadata = build_batch(case)
    expected_cache = cache.clone()
    reference_write_kv(key, value, expected_cache, metadata.slot_mapping)
    scale = case.head_size**-0.5
    expected = reference_paged_attention(query, expected_cache, metadata, scale)

    ops = TritonAttentionOps(case.params, case.num_splits)
    on_device = to_device(metadata, device)
    kernel_cache = cache.to(device)
    start = time.perf_counter()
    ops.write_kv(key.to(device), value.to(device), kernel_cache, on_device.slot_mapping)
    out = ops.forward(query.to(device), kernel_cache, on_device, scale).cpu()
    seconds = time.perf_counter() - start
    plan = plan_attention(
        num_seqs=metadata.num_seqs,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        dtype=query.dtype,
        params=case.params,
        interpret=triton_interpreting(),
        num_splits=case.num_splits,
    )
    return {
        "cache_equal": bool(torch.equal(kernel_cache.cpu(), expected_cache)),
        "max_error": (out.float() - expected.float()).abs().max().item(),
        "finite": bool(torch.isfinite(out).all()),
        "dtype": str(out.dtype).removeprefix("torch."),
        "num_splits": plan.num_splits,
        "seconds": round(seconds, 2),
    }


def run_padding_write(device: str) -> dict:
    """write_kv with padding slots: only the valid tokens land, nothing else changes."""
    from platform_core.attention.reference import reference_write_kv
    from platform_core.kernels.triton.write_kv import write_kv

    gen = torch.Generator().manual_seed(1)
    cache = torch.randn((2, 4, 16, 3, 64), generator=gen).to(torch.bfloat16)
    # Keys as the model hands them over: a view into a fused projection (rows 384 apart);
    # values with a strided last dim, which the launcher must make contiguous.
    fused = torch.randn((5, 384), generator=gen).to(torch.bfloat16)
    wide = torch.randn((5, 3, 128), generator=gen).to(torch.bfloat16)
    slots = torch.tensor([17, -1, 63, -1, 0], dtype=torch.int64)
    expected = cache.clone()
    reference_write_kv(fused[:, :192].view(5, 3, 64), wide[..., ::2], expected, slots)
    written = cache.to(device)
    fused, wide = fused.to(device), wide.to(device)
    write_kv(fused[:, :192].view(5, 3, 64), wide[..., ::2], written, slots.to(device))
    return {"cache_equal": bool(torch.equal(written.cpu(), expected))}


def run_empty_batch(device: str) -> dict:
    """A step with no tokens launches nothing and returns empty results."""
    from platform_core.attention.metadata import AttentionMetadata
    from platform_core.kernels.triton.ops import TritonAttentionOps

    cache = torch.zeros((2, 2, 16, 1, 64), device=device)
    empty = torch.zeros((0, 1, 64), device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        none[:1] * 0, none, none.view(0, 1), none.long(), 0, 0, 16, [0], []
    )
    ops = TritonAttentionOps()
    ops.write_kv(empty, empty, cache, metadata.slot_mapping)
    out = ops.forward(torch.zeros((0, 2, 64), device=device), cache, metadata, 0.125)
    return {"shape": list(out.shape), "cache_untouched": bool((cache == 0).all())}


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


def _aot_main() -> None:
    try:
        from platform_core_cuda.plugin import cuda_launch_params
        from platform_core_rocm.plugin import rocm_launch_params
    except ImportError as exc:
        print(json.dumps({"skipped": f"the cuda and rocm backends are not installed: {exc}"}))
        return
    params = {"cuda": cuda_launch_params(num_sms=132), "rocm": rocm_launch_params(304)}
    results = {}
    for name, variant in AOT_VARIANTS.items():
        try:
            results[name] = compile_variant(variant, params[variant.backend])
        except Exception as exc:  # reported per variant, asserted by the test
            results[name] = {"error": repr(exc)[-3000:]}
    print(json.dumps(results))


def _child_main() -> None:
    device = os.environ.get(DEVICE_ENV, "cpu")
    results = {name: run_case(case, device) for name, case in CASES.items()}
    results["padding_write"] = run_padding_write(device)
    results["empty_batch"] = run_empty_batch(device)
    print(json.dumps(results))


def _start_child(mode: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _collect(child: subprocess.Popen, what: str) -> dict:
    try:
        stdout, stderr = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise AssertionError(f"{what} child ran past {CHILD_TIMEOUT_S} s") from None
    assert child.returncode == 0, f"{what} child failed:\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child_results() -> dict[str, dict]:
    """Both children, run side by side: the kernel cases (interpreter, or a GPU) and AOT."""
    if not triton_installed():
        pytest.skip("triton is not installed (pip install triton==3.7.1)")
    device = os.environ.get(DEVICE_ENV, "cpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[DEVICE_ENV] = device
    cases = _start_child("cases", {**env, "TRITON_INTERPRET": "1"} if device == "cpu" else env)
    compiled = _start_child("aot", env)
    return {"cases": _collect(cases, "kernel"), "aot": _collect(compiled, "compile")}


@pytest.fixture(scope="module")
def kernel_results(child_results: dict[str, dict]) -> dict:
    return child_results["cases"]


@pytest.fixture(scope="module")
def aot_results(child_results: dict[str, dict]) -> dict:
    if "skipped" in child_results["aot"]:
        pytest.skip(child_results["aot"]["skipped"])
    return child_results["aot"]


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(kernel_results: dict, name: str) -> None:
    case, result = CASES[name], kernel_results[name]
    assert result["cache_equal"], "write_kv disagrees with the reference scatter"
    assert result["finite"]
    assert result["dtype"] == case.dtype
    assert result["max_error"] <= case.atol, f"{name}: max error {result['max_error']:.2e}"


def test_split_kv_cases_really_split(kernel_results: dict) -> None:
    assert kernel_results["decode_split4_fp16_block64_head256"]["num_splits"] == 4
    assert kernel_results["decode_split2_bf16_group8_head64"]["num_splits"] == 2
    assert kernel_results["mixed_auto_split_group3_fp32_head96"]["num_splits"] > 1
    assert kernel_results["mixed_gqa4_fp32_block16_head64"]["num_splits"] == 1


def test_write_kv_skips_padding_slots(kernel_results: dict) -> None:
    assert kernel_results["padding_write"]["cache_equal"]


def test_empty_batch_is_a_no_op(kernel_results: dict) -> None:
    assert kernel_results["empty_batch"] == {"shape": [0, 2, 64], "cache_untouched": True}


@pytest.mark.parametrize("name", list(AOT_VARIANTS))
def test_kernels_compile_for_each_backend_target(aot_results: dict, name: str) -> None:
    result = aot_results[name]
    assert "error" not in result, result.get("error")
    assert result["fits"], f"{name} needs more shared memory than the target has: {result}"


def test_aot_variants_cover_the_split_path(aot_results: dict) -> None:
    assert aot_results["sm90_decode_split_bf16_group3_head64"]["num_splits"] > 1
    assert "_combine_kernel" in aot_results["gfx942_decode_split_bf16_head96"]["shared"]


if __name__ == "__main__":
    _aot_main() if sys.argv[1:] == ["aot"] else _child_main()
