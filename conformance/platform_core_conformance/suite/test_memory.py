"""Memory profiling: a self-consistent report, a KV cache within its budget, no growth.

The profiler is handed a dummy forward that holds a known allocation on the device while it
runs attention (and for at least ``HOLD_S``, as a real forward holds its activations), so a
profiler that misses the peak is caught.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from platform_core import SamplingParams
from platform_core.backend_api import Backend, MemoryReport
from platform_core_conformance.batches import (
    AttentionShape,
    Seq,
    fill_cache,
    make_case,
    new_cache,
    run_forward,
)
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import kv_cache_bytes, live_tensor_bytes, make_llm
from platform_core_conformance.tiny_models import TinyModel, random_prompts

ALLOCATION_BYTES = 64 << 20
HOLD_S = 0.05
WEIGHTS_BYTES = 12_345_678
UTILIZATIONS = (0.3, 0.6, 0.9)
REPEATS = 4
# Allowed rise of the peak over REPEATS rounds of steps vs. one round (allocator noise).
GROWTH_SLACK_BYTES = 2 << 20


def _dummy_forward(backend: Backend, base_head_size: int, calls: list[int]) -> Callable[[], None]:
    def run() -> None:
        calls.append(1)
        dtype = backend.capabilities.dtypes[0]
        size = backend.capabilities.block_sizes[0]
        scratch = torch.ones(ALLOCATION_BYTES // 4, dtype=torch.float32, device=backend.device)
        case = make_case(AttentionShape(4, 2, base_head_size, size, dtype), [Seq(0, 64)], seed=0)
        cache = new_cache(backend.attention, case, backend.device)
        fill_cache(backend.attention, case, cache)
        run_forward(backend.attention, case, cache, backend.device)
        backend.synchronize()
        time.sleep(HOLD_S)
        del scratch

    return run


@pytest.fixture(scope="module")
def profiled(backend: Backend, base_head_size: int) -> tuple[MemoryReport, int]:
    """One profile of the dummy forward, and how often the profiler ran it."""
    calls: list[int] = []
    report = backend.memory.profile(_dummy_forward(backend, base_head_size, calls), WEIGHTS_BYTES)
    return report, len(calls)


def test_profile_report_is_self_consistent(
    profiled: tuple[MemoryReport, int], record_property: Callable[[str, object], None]
) -> None:
    report, calls = profiled
    for field in ("total_bytes", "available_bytes", "weights_bytes", "peak_bytes"):
        record_property(field, getattr(report, field))
    assert calls == 1, f"the profiler ran the dummy forward {calls} times, not once"
    assert isinstance(report.device, str) and report.device
    assert report.total_bytes > 0
    assert 0 <= report.available_bytes <= report.total_bytes
    assert report.weights_bytes == WEIGHTS_BYTES, "weights_bytes must be reported as given"
    assert 0 <= report.peak_bytes <= report.total_bytes
    assert report.peak_bytes >= 0.9 * ALLOCATION_BYTES, (
        f"peak {report.peak_bytes} B missed the {ALLOCATION_BYTES} B the forward held"
    )


def test_kv_budget_fits_free_memory(backend: Backend, profiled: tuple[MemoryReport, int]) -> None:
    report, _ = profiled
    budgets = [backend.memory.kv_cache_budget(report, u) for u in UTILIZATIONS]
    free_after_peak = max(0, report.available_bytes - report.peak_bytes)
    for utilization, budget in zip(UTILIZATIONS, budgets):
        assert 0 <= budget <= free_after_peak, (utilization, budget, free_after_peak)
        assert budget <= utilization * report.total_bytes, (utilization, budget)
    assert budgets == sorted(budgets), f"budget shrinks as utilization grows: {budgets}"


def test_kv_cache_layout_fits_the_planned_bytes(conformance: ConformanceContext) -> None:
    caps, ops = conformance.capabilities, conformance.backend.attention
    num_blocks, num_kv_heads = 3, 2
    for head_size in caps.head_sizes:
        for block_size in caps.block_sizes:
            shape = ops.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
            planned = 2 * num_blocks * block_size * num_kv_heads * head_size
            assert 0 < torch.Size(shape).numel() <= planned, (head_size, block_size, shape)


def test_engine_kv_cache_stays_within_its_budget(
    conformance: ConformanceContext, tiny_model: Callable[..., TinyModel]
) -> None:
    blocks = 20
    llm = make_llm(conformance, tiny_model("llama").path, num_gpu_blocks_override=blocks)
    info = llm.kv_cache_info()
    budget = blocks * info.bytes_per_block
    assert llm.stats()["kv_blocks_total"] == blocks == info.num_blocks
    assert kv_cache_bytes(llm) <= budget, f"{kv_cache_bytes(llm)} B allocated for {budget} B"
    assert {d.type for d in info.devices} == {conformance.backend.device.type}, info.devices


def test_memory_does_not_grow_across_steps(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    record_property: Callable[[str, object], None],
) -> None:
    backend = conformance.backend
    llm = make_llm(conformance, tiny_model("llama").path, num_gpu_blocks_override=64)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 23, 40], seed=11)]

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def rounds(count: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                llm.generate(prompts, params, use_tqdm=False)

        return run

    rounds(2)()  # warm-up: lazily built buffers and caches exist from here on
    live_before = live_tensor_bytes(backend.device)
    short = backend.memory.profile(rounds(1), 0).peak_bytes
    long = backend.memory.profile(rounds(REPEATS), 0).peak_bytes
    live_after = live_tensor_bytes(backend.device)
    record_property("peak_one_round_bytes", short)
    record_property(f"peak_{REPEATS}_rounds_bytes", long)
    record_property("live_tensor_growth_bytes", live_after - live_before)
    assert live_after <= live_before, f"live tensors grew by {live_after - live_before} B"
    assert long <= short + GROWTH_SLACK_BYTES + short // 4, (
        f"peak over {REPEATS} rounds {long} B vs. one round {short} B: memory grows per step"
    )
