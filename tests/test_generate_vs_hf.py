"""End to end: greedy tokens equal HF transformers' token for token (fp32), on the CPU backend.

Four engine configurations run the same prompts: defaults; a token budget that chunks prefills;
shared prefixes with prefix caching (hits asserted); a KV pool so small that requests are
preempted (asserted). The tokens must not change in any of them.
"""

from __future__ import annotations

import random

import pytest
import torch

from platform_core import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3"]
MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 2, 7, 16, 17, 40, 129, 300]


def make_prompts(lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(70)]
    return [prefix + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 5, 16, 33)]


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        results.append(out[0, len(prompt) :].tolist())
    return results


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output in outputs:
        assert output.finished and output.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_freed(llm: LLM) -> None:
    llm.check_kv_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_dir, hf_reference_model):
    name = request.param
    prompts = make_prompts(PROMPT_LENGTHS, seed=ARCHS.index(name))  # str hash() is per-process
    shared = shared_prefix_prompts(seed=7)
    model = hf_reference_model(name)
    return {
        "dir": str(tiny_model_dir(name)),
        "prompts": prompts,
        "expected": hf_greedy(model, prompts, MAX_TOKENS),
        "shared": shared,
        "shared_expected": hf_greedy(model, shared, MAX_TOKENS),
    }


def test_defaults(arch_case):
    llm = LLM(arch_case["dir"], dtype="float32")
    assert generate(llm, arch_case["prompts"]) == arch_case["expected"]
    assert_all_freed(llm)


def test_chunked_prefill_over_several_steps(arch_case):
    budget = 32
    llm = LLM(arch_case["dir"], dtype="float32", max_num_batched_tokens=budget)
    assert generate(llm, arch_case["prompts"]) == arch_case["expected"]
    total_prompt = sum(len(p) for p in arch_case["prompts"])
    # Every step computes at most `budget` tokens, so the prompts alone need this many steps.
    assert llm.stats()["num_steps"] >= -(-total_prompt // budget)
    assert llm.stats()["max_batch_size"] > 1
    assert_all_freed(llm)


def test_prefix_caching_hits_and_same_tokens(arch_case):
    llm = LLM(arch_case["dir"], dtype="float32", enable_prefix_caching=True, block_size=16)
    shared, expected = arch_case["shared"], arch_case["shared_expected"]
    assert generate(llm, shared[:1]) == expected[:1]
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    assert generate(llm, shared[1:]) == expected[1:]
    # 70 shared tokens = 4 full blocks of 16 for each of the three later prompts.
    assert llm.stats()["prefix_cache_hit_tokens"] == 3 * 4 * 16
    assert_all_freed(llm)


def test_preemption_keeps_tokens(arch_case):
    # 20 blocks x 16 = 320 tokens: the 300-token prompt (+12) fits alone, not beside the others,
    # and the seven shorter ones admitted first outgrow the pool while decoding.
    llm = LLM(arch_case["dir"], dtype="float32", num_gpu_blocks_override=20, block_size=16)
    assert generate(llm, arch_case["prompts"]) == arch_case["expected"]
    assert llm.stats()["num_preemptions"] > 0
    assert_all_freed(llm)


def test_prefix_caching_off_gets_no_hits(arch_case):
    llm = LLM(arch_case["dir"], dtype="float32", enable_prefix_caching=False)
    assert generate(llm, arch_case["shared"]) == arch_case["shared_expected"]
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
