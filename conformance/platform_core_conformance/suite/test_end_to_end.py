"""End to end, in every declared dtype: greedy generations of tiny seeded models vs HF's.

HF transformers' model (computing in float32 from weights rounded to the dtype) is
teacher-forced on the backend's tokens (``generation``): each
token must be the reference's choice or a near-tie within the dtype's logprob tolerance, its
logprob must match, and a failure reads "backend vs reference: first divergence at token k of
prompt p". The greedy check runs over (head size, block size) pairs covering the declaration,
and with embeddings of tiny and large magnitude; prefix caching (hits asserted), chunked prefill
(a small token budget), forced preemption (a tiny KV pool), n > 1 and n-gram speculative
decoding must keep the tokens right too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from platform_core import LLM
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.engine import (
    E2E_MAX_TOKENS,
    assert_all_freed,
    generate_greedy,
    make_llm,
)
from platform_core_conformance.generation import Reference, judge
from platform_core_conformance.tiny_models import TinyModel, random_prompts
from platform_core_conformance.tolerances import logprob_atol_for

pytestmark = pytest.mark.requires("write_kv", "padding")

CHUNK_BUDGET = 24  # tokens per step: prefills are cut into chunks not aligned to blocks
EOS_ID = 2  # blocked by min_tokens on both sides
MAGNITUDES = {"tiny": 1e-3, "large": 3000.0}  # large: |x| > 256 squares to inf in float16


class Run:
    """One engine on the backend under test, and the judging of its generations."""

    def __init__(
        self,
        conformance: ConformanceContext,
        model: TinyModel,
        dtype: str,
        reference: Callable[[TinyModel, str], Reference],
        record_property: Callable[[str, object], None],
        **engine: object,
    ) -> None:
        self.llm: LLM = make_llm(conformance, model.path, dtype=dtype, **engine)
        self.model, self.dtype = model, dtype
        self.reference = reference(model, dtype)
        self.record_property = record_property
        self.worst = 0.0

    @property
    def block_size(self) -> int:
        return self.llm.stats()["kv_block_size"]  # the backend may have adjusted it

    def check(self, prompts: list[list[int]], n: int = 1) -> None:
        """Generate greedily and fail with the first divergence from the reference; every KV
        block must be free afterwards."""
        atol = logprob_atol_for(self.dtype)
        verdict = judge(
            generate_greedy(self.llm, prompts, E2E_MAX_TOKENS, n),
            self.reference,
            atol,
            blocked=frozenset({EOS_ID}),
        )
        self.worst = max(self.worst, verdict.max_logprob_error)
        self.record_property("max_abs_error", self.worst)
        self.record_property("atol", atol)
        if verdict.failure is not None:
            raise AssertionError(f"{self.model.label}, {self.dtype}: {verdict.failure}")
        assert_all_freed(self.llm)


@pytest.fixture
def run(
    conformance: ConformanceContext,
    hf_reference: Callable[[TinyModel, str], Reference],
    record_property: Callable[[str, object], None],
) -> Callable[..., Run]:
    """Factory: ``run(model, dtype, **engine)`` -> a :class:`Run` of this check."""

    def make(model: TinyModel, dtype: str, **engine: object) -> Run:
        return Run(conformance, model, dtype, hf_reference, record_property, **engine)

    return make


def _require(conformance: ConformanceContext, feature: str) -> None:
    if feature not in conformance.capabilities.features:
        pytest.skip(f"the backend does not declare the {feature!r} feature")


def _mixed_prompts(b: int, seed: int) -> list[list[int]]:
    return random_prompts([1, 2, b - 1 or 3, b, b + 1, 3 * b + 5], seed=seed)


def test_greedy_matches_hf_over_the_matrix(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    matrix_point: tuple[int, int],
) -> None:
    head_size, block_size = matrix_point
    engine = run(tiny_model("llama", head_size), dtype, block_size=block_size)
    engine.check(_mixed_prompts(engine.block_size, seed=1))


@pytest.mark.parametrize("arch", ["qwen2"])  # q/k/v projections with biases
def test_greedy_matches_hf_with_biases(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
    arch: str,
) -> None:
    engine = run(tiny_model(arch), dtype, block_size=base_block_size)
    engine.check(_mixed_prompts(engine.block_size, seed=1))


@pytest.mark.parametrize("magnitude", list(MAGNITUDES))
def test_greedy_matches_hf_at_activation_magnitudes(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
    magnitude: str,
) -> None:
    model = tiny_model("llama", magnitude=MAGNITUDES[magnitude])
    engine = run(model, dtype, block_size=base_block_size)
    engine.check(_mixed_prompts(engine.block_size, seed=6))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_caching_hits_and_keeps_tokens(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
    arch: str,
) -> None:
    _require(conformance, "prefix_caching")
    engine = run(tiny_model(arch), dtype, block_size=base_block_size, enable_prefix_caching=True)
    b = engine.block_size
    prefix = random_prompts([3 * b + 5], seed=2)[0]
    prompts = [prefix + tail for tail in random_prompts([1, 4, b + 2, 7], seed=3)]
    engine.check(prompts[:1])
    assert engine.llm.stats()["prefix_cache_hit_tokens"] == 0
    engine.check(prompts[1:])
    # Each later prompt finds the three full blocks of the shared prefix.
    assert engine.llm.stats()["prefix_cache_hit_tokens"] == 3 * 3 * b


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_keeps_tokens(
    conformance: ConformanceContext,
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
    arch: str,
) -> None:
    _require(conformance, "chunked_prefill")
    prompts = random_prompts([3, 2 * base_block_size + 5, 61, 100], seed=4)
    engine = run(
        tiny_model(arch), dtype, block_size=base_block_size, max_num_batched_tokens=CHUNK_BUDGET
    )
    engine.check(prompts)
    # No step computes more than the budget, so the prompts alone need this many steps.
    total = sum(len(p) for p in prompts)
    assert engine.llm.stats()["num_steps"] >= -(-total // CHUNK_BUDGET)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_keeps_tokens(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
    arch: str,
) -> None:
    engine = run(tiny_model(arch), dtype, block_size=base_block_size, num_gpu_blocks_override=8)
    # Four prompts of two full blocks fill the pool; the first decode of each needs a 9th block.
    engine.check(random_prompts([2 * engine.block_size] * 4, seed=5))
    assert engine.llm.stats()["num_preemptions"] > 0


def test_n_completions_each_match_hf(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
) -> None:
    engine = run(tiny_model("llama"), dtype, block_size=base_block_size)
    engine.check(random_prompts([5, base_block_size + 3], seed=7), n=3)


def test_ngram_speculative_decoding_keeps_tokens(
    tiny_model: Callable[..., TinyModel],
    run: Callable[..., Run],
    dtype: str,
    base_block_size: int,
) -> None:
    engine = run(
        tiny_model("llama"),
        dtype,
        block_size=base_block_size,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    # Repeated phrases: the n-gram proposer finds drafts in every prompt.
    prompts = [phrase * 6 for phrase in random_prompts([3, 5, 4], seed=8)]
    engine.check(prompts)
    assert engine.llm.stats()["spec_verifications"] > 0, "no draft was ever verified"
