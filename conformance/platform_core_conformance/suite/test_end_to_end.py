"""End to end: greedy tokens of tiny seeded models equal HF transformers' (float32).

The same prompts run with defaults, with prefix caching (hits asserted), with chunked prefill
(a small token budget) and with forced preemption (a tiny KV pool); the tokens must not change.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import E2E_MAX_TOKENS, assert_all_freed, greedy, make_llm
from platform_core_conformance.tiny_models import TinyModel, random_prompts
from platform_core_conformance.tolerances import LOGPROB_ATOL

HfReference = Callable[[TinyModel, list[int]], tuple[list[int], list[float]]]
CHUNK_BUDGET = 24  # tokens per step: prefills are cut into chunks not aligned to blocks


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., TinyModel]) -> TinyModel:
    return tiny_model(request.param)


def _expected(hf_reference: HfReference, model: TinyModel, prompts: list[list[int]]):
    return [hf_reference(model, p)[0] for p in prompts]


def _require(conformance: ConformanceContext, feature: str) -> None:
    if feature not in conformance.capabilities.features:
        pytest.skip(f"the backend does not declare the {feature!r} feature")


def test_greedy_tokens_and_logprobs_match_hf(
    conformance: ConformanceContext,
    model: TinyModel,
    engine_dtype: str,
    base_block_size: int,
    hf_reference: HfReference,
    record_property: Callable[[str, object], None],
) -> None:
    b = base_block_size
    prompts = random_prompts([1, 2, b - 1 or 3, b, b + 1, 3 * b + 5], seed=1)
    llm = make_llm(conformance, model.path, dtype=engine_dtype, block_size=b)
    tokens, logprobs = greedy(llm, prompts, E2E_MAX_TOKENS)
    assert tokens == _expected(hf_reference, model, prompts)
    error = max(
        abs(ours - theirs)
        for prompt, row in zip(prompts, logprobs)
        for ours, theirs in zip(row, hf_reference(model, prompt)[1])
    )
    record_property("max_abs_error", error)
    record_property("atol", LOGPROB_ATOL)
    assert error <= LOGPROB_ATOL, f"logprobs differ from HF by up to {error:.3g}"
    assert_all_freed(llm)


def test_prefix_caching_hits_and_keeps_tokens(
    conformance: ConformanceContext,
    model: TinyModel,
    engine_dtype: str,
    base_block_size: int,
    hf_reference: HfReference,
) -> None:
    _require(conformance, "prefix_caching")
    llm = make_llm(
        conformance,
        model.path,
        dtype=engine_dtype,
        block_size=base_block_size,
        enable_prefix_caching=True,
    )
    b = llm.stats()["kv_block_size"]  # the backend may have adjusted it
    prefix = random_prompts([3 * b + 5], seed=2)[0]
    prompts = [prefix + tail for tail in random_prompts([1, 4, b + 2, 7], seed=3)]
    expected = _expected(hf_reference, model, prompts)
    assert greedy(llm, prompts[:1], E2E_MAX_TOKENS)[0] == expected[:1]
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    assert greedy(llm, prompts[1:], E2E_MAX_TOKENS)[0] == expected[1:]
    # Each later prompt finds the three full blocks of the shared prefix.
    assert llm.stats()["prefix_cache_hit_tokens"] == 3 * 3 * b
    assert_all_freed(llm)


def test_chunked_prefill_keeps_tokens(
    conformance: ConformanceContext,
    model: TinyModel,
    engine_dtype: str,
    base_block_size: int,
    hf_reference: HfReference,
) -> None:
    _require(conformance, "chunked_prefill")
    prompts = random_prompts([3, 2 * base_block_size + 5, 61, 100], seed=4)
    llm = make_llm(
        conformance,
        model.path,
        dtype=engine_dtype,
        block_size=base_block_size,
        max_num_batched_tokens=CHUNK_BUDGET,
    )
    assert greedy(llm, prompts, E2E_MAX_TOKENS)[0] == _expected(hf_reference, model, prompts)
    # No step computes more than the budget, so the prompts alone need this many steps.
    total = sum(len(p) for p in prompts)
    assert llm.stats()["num_steps"] >= -(-total // CHUNK_BUDGET)
    assert_all_freed(llm)


def test_preemption_keeps_tokens(
    conformance: ConformanceContext,
    model: TinyModel,
    engine_dtype: str,
    base_block_size: int,
    hf_reference: HfReference,
) -> None:
    llm = make_llm(
        conformance,
        model.path,
        dtype=engine_dtype,
        block_size=base_block_size,
        num_gpu_blocks_override=8,
    )
    b = llm.stats()["kv_block_size"]
    # Four prompts of two full blocks fill the pool; the first decode of each needs a 9th block.
    prompts = random_prompts([2 * b] * 4, seed=5)
    assert greedy(llm, prompts, E2E_MAX_TOKENS)[0] == _expected(hf_reference, model, prompts)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_freed(llm)
