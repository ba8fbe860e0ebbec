"""Speculative decoding: lossless for greedy and for sampling, consistent block accounting."""

from __future__ import annotations

import random

import pytest
import torch

from platform_core import LLM, SamplingParams
from platform_core.sample.draft_verify import DraftGroup, verify
from platform_core.sample.metadata import GeneratorStore, SampleRow, build_sampling_metadata
from platform_core.sample.sampler import Sampler
from platform_core.speculative.ngram import NgramProposer


def test_ngram_proposes_the_continuation_of_the_latest_match():
    proposer = NgramProposer(num_tokens=3, ngram_min=1, ngram_max=3)
    assert proposer.propose_for([1, 2, 3, 4, 9, 1, 2, 3], limit=10) == [4, 9, 1]
    assert proposer.propose_for([7, 1, 5, 8, 1, 6, 8, 1], limit=10) == [6, 8, 1]  # latest "8 1"
    assert proposer.propose_for([1, 2, 3, 4, 9, 1, 2, 3], limit=2) == [4, 9]
    assert proposer.propose_for([5, 6, 7], limit=10) == []


def prompts_with_and_without_repetition() -> list[list[int]]:
    rng = random.Random(3)
    motif = [rng.randrange(3, 256) for _ in range(12)]
    repetitive = [(motif * 6)[:n] for n in (25, 40, 71)]
    plain = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 33, 130)]
    return repetitive + plain


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_outputs_are_unchanged(tiny_model_dir, arch):
    prompts = [{"prompt_token_ids": p} for p in prompts_with_and_without_repetition()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    model = str(tiny_model_dir(arch))
    plain = LLM(model, dtype="float32")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # Chunked prefill, prefix caching, a pool small enough to preempt, and n > 1 all at once.
    spec = LLM(
        model,
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=4,
        max_num_batched_tokens=48,
        num_gpu_blocks_override=16,
        block_size=16,
    )
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = spec.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["num_preemptions"] > 0
    n_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    forked = spec.generate(prompts[0], n_params, use_tqdm=False)[0]
    assert [o.token_ids for o in forked.outputs] == [expected[0], expected[0]]
    spec.check_kv_integrity()
    assert spec.stats()["kv_blocks_used"] == 0


def _rows(params: SamplingParams, count: int) -> list[SampleRow]:
    return [
        SampleRow(
            request_id=f"r{i}", sampling_params=params, prompt_token_ids=[], output_token_ids=[]
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    vocab, trials = 6, 6000
    target_logits = torch.tensor([1.2, 0.3, -0.5, 0.8, 0.0, -1.0])
    target = torch.softmax(target_logits, dim=0)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.tensor([0.0, 1.5, 0.2, -0.3, 0.9, 0.1]), dim=0)
    groups, rows = [], []
    for t in range(trials):
        if draft_kind == "point":
            draft, probs = 1, None  # always proposes token 1 (prompt lookup is deterministic)
        else:
            draft = int(torch.multinomial(q, 1, generator=gen))
            probs = q.unsqueeze(0).repeat(2, 1)[:1]
        groups.append(DraftGroup(2 * t, [draft], probs))
        rows += _rows(params, 2)
    logits = target_logits.repeat(2 * trials, 1)
    meta = build_sampling_metadata(rows, GeneratorStore(), frozenset(), torch.device("cpu"))
    accepted = verify(Sampler(torch.Generator().manual_seed(1)), logits, meta, groups)
    first = torch.tensor([tokens[0] for tokens in accepted])
    observed = torch.bincount(first, minlength=vocab).double()
    expected = target.double() * trials
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.52, f"chi-square {chi2:.1f} over the p=0.001 bound (5 dof)"
    # Accepted groups also yield a bonus token: two tokens instead of one.
    assert any(len(tokens) == 2 for tokens in accepted)


def test_sampling_with_speculation_runs_and_frees_everything(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    prompt = {"prompt_token_ids": prompts_with_and_without_repetition()[1]}
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again and len(first) == 30
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0


def test_draft_model_greedy_is_lossless_and_a_perfect_draft_is_always_accepted(tiny_model_dir):
    prompts = [{"prompt_token_ids": p} for p in prompts_with_and_without_repetition()]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    target = str(tiny_model_dir("llama"))
    plain = LLM(target, dtype="float32")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # The target as its own draft: every greedy draft must be accepted, which only holds if
    # the draft cache (same block ids as the target's) is right after catch-up and rollback.
    same = LLM(
        target,
        dtype="float32",
        speculative_method="draft",
        draft_model=target,
        num_speculative_tokens=3,
        max_num_batched_tokens=64,
    )
    got = [o.outputs[0].token_ids for o in same.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = same.stats()
    assert stats["spec_proposed_tokens"] > 0
    assert stats["spec_acceptance_rate"] == 1.0
    # A different (weaker) draft model: drafts get rejected, outputs still identical.
    other = LLM(
        target,
        dtype="float32",
        speculative_method="draft",
        draft_model=str(tiny_model_dir("qwen2")),
        num_speculative_tokens=3,
        num_gpu_blocks_override=24,
    )
    got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert other.stats()["spec_acceptance_rate"] < 1.0
    for llm in (same, other):
        llm.check_kv_integrity()
        assert llm.stats()["kv_blocks_used"] == 0


def test_draft_model_sampling_is_reproducible_with_a_seed(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        speculative_method="draft",
        draft_model=str(tiny_model_dir("qwen2")),
        num_speculative_tokens=2,
    )
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.stats()["spec_proposed_tokens"] > 0


def test_speculation_counters_reach_the_bench_result(tiny_model_dir):
    from platform_core.bench.throughput import run_throughput
    from platform_core.bench.workloads import BenchRequest

    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    motif = prompts_with_and_without_repetition()[2]
    result = run_throughput(llm, [BenchRequest(prompt_token_ids=motif, max_tokens=20)] * 2)
    assert result.spec_proposed_tokens > 0
    assert 0.0 <= result.spec_acceptance_rate <= 1.0
    assert result.spec_mean_accepted_length >= 1.0
    assert result.to_dict()["spec_acceptance_rate"] == result.spec_acceptance_rate


def test_speculation_pauses_for_large_decode_batches(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_disable_by_batch_size=2,
    )
    motif = prompts_with_and_without_repetition()[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": motif}] * 3, params, use_tqdm=False)
    assert llm.stats()["spec_proposed_tokens"] == 0  # three decoding together: no drafts
    llm.generate({"prompt_token_ids": motif}, params, use_tqdm=False)
    assert llm.stats()["spec_proposed_tokens"] > 0  # alone: drafts again
