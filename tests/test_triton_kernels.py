"""The shared Triton paged-attention kernels against the pure-torch reference, and compiled.

Triton must see ``TRITON_INTERPRET=1`` before the kernels are decorated, so the kernel cases run
in a child process (this file run as a script) with the variable set; the child reports one JSON
line and the tests here assert on it. ``PLATFORM_CORE_KERNEL_DEVICE=cuda`` runs the same cases
compiled on a real GPU instead (``benchmarks/gpu_check.sh``).

Each case scatters fresh K/V into a cache full of random stale data with the kernel and with the
reference (the caches must match exactly), then compares attention. The kernels compiled for real
GPU targets are checked in ``test_triton_aot.py``; the launch-planning rules are plain Python and
tested in ``test_triton_launch_plan.py``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import pytest
import torch
from json_child import collect, start_child

from platform_core.kernels.triton import triton_installed
from platform_core.kernels.triton.launch import LaunchParams, plan_attention

DEVICE_ENV = "PLATFORM_CORE_KERNEL_DEVICE"
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


def _child_main() -> None:
    device = os.environ.get(DEVICE_ENV, "cpu")
    results = {name: run_case(case, device) for name, case in CASES.items()}
    results["padding_write"] = run_padding_write(device)
    results["empty_batch"] = run_empty_batch(device)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    """The kernel cases, run in a child under the interpreter (or on a GPU)."""
    if not triton_installed():
        pytest.skip("triton is not installed (pip install triton==3.7.1)")
    device = os.environ.get(DEVICE_ENV, "cpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[DEVICE_ENV] = device
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return collect(start_child(__file__, "cases", env), "kernel")


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


if __name__ == "__main__":
    _child_main()
