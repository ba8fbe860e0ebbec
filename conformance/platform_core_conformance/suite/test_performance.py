"""Performance smoke: tokens/s of the backend vs the reference, reported and never a threshold.

The attention check times one decode batch through the backend's ``forward`` and through the
reference in the same run; the engine check times greedy generation of a tiny model. The figures
go to both reports (``backend_tokens_per_s``, ``reference_tokens_per_s``, ``speedup``), so a
vendor sees a 6x slowdown; only wrong results fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from platform_core.backend_api import AttentionOps, Backend, ReferenceAttentionOps
from platform_core_conformance.batches import (
    AttentionCase,
    AttentionShape,
    Seq,
    expected_output,
    fill_cache,
    make_case,
    new_cache,
    run_forward,
)
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import generate_greedy, make_llm
from platform_core_conformance.tiny_models import TinyModel, random_prompts
from platform_core_conformance.tolerances import compare, tolerance_for

pytestmark = pytest.mark.requires("write_kv", "padding")

DECODE_BATCH = [Seq(255, 1)] * 8
ROUNDS = 5
ENGINE_TOKENS = 16


def _tokens_per_s(ops: AttentionOps, case: AttentionCase, backend: Backend) -> float:
    cache = new_cache(ops, case, backend.device)
    fill_cache(ops, case, cache)
    run_forward(ops, case, cache, backend.device)  # warm-up: first-call compilation
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        out = run_forward(ops, case, cache, backend.device)
    backend.synchronize()
    elapsed = time.perf_counter() - start
    compare(out, expected_output(case), tolerance_for(case.shape.dtype)).check(case.locate)
    return ROUNDS * len(case.seqs) / elapsed


def test_attention_decode_tokens_per_s(
    backend: Backend,
    dtype: str,
    base_head_size: int,
    base_block_size: int,
    record_property: Callable[[str, object], None],
) -> None:
    shape = AttentionShape(8, 2, base_head_size, base_block_size, dtype)
    case = make_case(shape, DECODE_BATCH, seed=9)
    ours = _tokens_per_s(backend.attention, case, backend)
    reference = _tokens_per_s(ReferenceAttentionOps(), case, backend)
    record_property("backend_tokens_per_s", round(ours, 1))
    record_property("reference_tokens_per_s", round(reference, 1))
    record_property("speedup", round(ours / reference, 3))


def test_engine_generation_tokens_per_s(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    dtype: str,
    record_property: Callable[[str, object], None],
) -> None:
    llm = make_llm(conformance, tiny_model("llama").path, dtype=dtype)
    prompts = random_prompts([16] * 4, seed=10)
    generate_greedy(llm, prompts, 2)  # warm-up
    start = time.perf_counter()
    generations = generate_greedy(llm, prompts, ENGINE_TOKENS)
    elapsed = time.perf_counter() - start
    assert all(len(g.tokens) == ENGINE_TOKENS for g in generations)
    record_property("backend_tokens_per_s", round(len(prompts) * ENGINE_TOKENS / elapsed, 1))
