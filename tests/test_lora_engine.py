"""Multi-LoRA in the engine: greedy tokens equal HF transformers + PEFT, adapters mixed in a step.

Every adapter is random (A and B) and made with peft from the same tiny checkpoint the engine
serves; each request's tokens must equal PEFT's greedy tokens for its adapter (or the base
model's without one), whichever other adapters share its steps. The engine runs float32 on the
CPU backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from platform_core import LLM, LoRARequest, SamplingParams
from platform_core.errors import InvalidRequestError, LoRAAdapterError
from tests.lora_utils import ALL_TARGETS, ATTENTION, MLP, make_adapter
from tests.test_generate_vs_hf import assert_all_freed, hf_greedy, make_prompts

MAX_TOKENS = 8
PROMPT_LENGTHS = [3, 16, 17, 40]
# (targets, rank, rsLoRA) of the adapters each architecture is tested with
ADAPTERS = [
    (ATTENTION, 8, False),
    (MLP, 16, False),
    (ALL_TARGETS, 1, False),
    (("q_proj", "v_proj"), 4, True),
]


class Case:
    """One architecture's model, prompts, adapters and PEFT's greedy tokens for each."""

    def __init__(self, name: str, model_dir: Path, hf_model: Any, adapter_root: Path) -> None:
        self.name = name
        self.model_dir = str(model_dir)
        self.prompts = make_prompts(PROMPT_LENGTHS, seed=11)
        self.base_expected = hf_greedy(hf_model, self.prompts, MAX_TOKENS)
        self.adapters: list[LoRARequest] = []
        self.expected: dict[int, list[list[int]]] = {}
        for index, (targets, rank, rslora) in enumerate(ADAPTERS, start=1):
            path = adapter_root / f"adapter-{index}"
            peft_model = make_adapter(hf_model, path, targets, rank, seed=index, use_rslora=rslora)
            self.adapters.append(LoRARequest(f"{name}-{index}", index, str(path)))
            self.expected[index] = hf_greedy(peft_model, self.prompts, MAX_TOKENS)

    def expected_for(self, lora: LoRARequest | None) -> list[list[int]]:
        return self.base_expected if lora is None else self.expected[lora.lora_int_id]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_model_dir, hf_reference_model, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(f"lora-{name}")
    return Case(name, tiny_model_dir(name), hf_reference_model(name), root)


def greedy(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], n: int = 1
) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [[sample.token_ids for sample in output.outputs] for output in outputs]


def record_plans(llm: LLM) -> list[Any]:
    """Every step plan the driver makes from now on."""
    runner = llm.engine.runner
    plans: list[Any] = []
    plan = runner.plan

    def recording(output: Any) -> Any:
        plans.append(plan(output))
        return plans[-1]

    runner.plan = recording
    return plans


def test_adapters_change_the_tokens(case):
    """The test is only as good as its adapters: each must change some greedy token."""
    for lora in case.adapters:
        assert case.expected_for(lora) != case.base_expected, lora.lora_name


def test_base_and_three_adapters_in_one_step_equal_peft(case):
    llm = LLM(case.model_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)
    plans = record_plans(llm)
    for adapters in (case.adapters[:3], case.adapters[1:]):
        loras: list[LoRARequest | None] = [None, *adapters]
        prompts = [p for p in case.prompts for _ in loras]
        requested = loras * len(case.prompts)
        got = greedy(llm, prompts, requested)
        for i, (tokens, lora) in enumerate(zip(got, requested, strict=True)):
            assert tokens == [case.expected_for(lora)[i // len(loras)]], (i, lora)
    mixed = [p.lora for p in plans if p.lora is not None and (p.lora.token_slots < 0).any()]
    assert any(len(step.adapters) == 3 for step in mixed), "base + 3 adapters never shared a step"
    assert_all_freed(llm)


def test_chunked_prefill_preemption_forks_and_ngram_drafts_keep_adapter_tokens(case):
    llm = LLM(
        case.model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_batched_tokens=16,  # every prompt but the first is chunked
        block_size=8,
        num_gpu_blocks_override=12,  # too few for every request at once: preemption
        speculative_method="ngram",
        num_speculative_tokens=2,
    )
    loras = [case.adapters[0], None, case.adapters[3], case.adapters[0]]
    got = greedy(llm, case.prompts, loras, n=2)
    for i, (samples, lora) in enumerate(zip(got, loras, strict=True)):
        assert samples == [case.expected_for(lora)[i]] * 2, (i, lora)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_freed(llm)


def test_more_adapters_than_slots_and_host_cache_reload_to_the_same_tokens(case):
    llm = LLM(
        case.model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=16,
    )
    loras = [case.adapters[i % 3] for i in range(6)]
    prompts = [case.prompts[i % len(case.prompts)] for i in range(6)]
    plans = record_plans(llm)
    for _ in range(2):  # the second round reloads every adapter from disk
        got = greedy(llm, prompts, loras)
        for i, (tokens, lora) in enumerate(zip(got, loras, strict=True)):
            assert tokens == [case.expected_for(lora)[i % len(case.prompts)]], (i, lora)
    assert all(len(p.lora.adapters) == 1 for p in plans if p.lora is not None)
    assert len(llm.engine.runner.lora.loaded_ids) == 1
    assert_all_freed(llm)


def test_prefix_cache_hits_within_an_adapter_never_across(case):
    llm = LLM(case.model_dir, dtype="float32", enable_lora=True, max_loras=2, block_size=8)
    prompt = [{"prompt_token_ids": case.prompts[3]}]  # 40 tokens: 4 full blocks to share
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, second = case.adapters[0], case.adapters[1]

    def cached(lora: LoRARequest | None) -> int:
        output = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
        return output.num_cached_tokens

    assert cached(first) == 0
    assert cached(second) == 0
    assert cached(None) == 0
    assert cached(first) == 32
    assert cached(second) == 32
    assert cached(None) == 32
    assert_all_freed(llm)


def test_tensor_parallel_shards_adapters_like_their_layers(case):
    loras = [None, *case.adapters]
    with LLM(
        case.model_dir,
        dtype="float32",
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    ) as llm:
        prompts = [case.prompts[i % len(case.prompts)] for i in range(len(loras))]
        got = greedy(llm, prompts, loras)
        for i, (tokens, lora) in enumerate(zip(got, loras, strict=True)):
            assert tokens == [case.expected_for(lora)[i % len(case.prompts)]], (i, lora)
        assert_all_freed(llm)


def test_requests_with_adapters_are_refused_clearly(case, tmp_path):
    base = LLM(case.model_dir, dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable-lora"):
        greedy(base, case.prompts[:1], [case.adapters[0]])
    llm = LLM(case.model_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match="16"):  # rank 16 above --max-lora-rank 8
        greedy(llm, case.prompts[:1], [case.adapters[1]])
    with pytest.raises(LoRAAdapterError):
        greedy(llm, case.prompts[:1], [LoRARequest("missing", 9, str(tmp_path / "nowhere"))])
    greedy(llm, case.prompts[:1], [case.adapters[0]])
    reused = LoRARequest("other", case.adapters[0].lora_int_id, case.adapters[2].lora_path)
    with pytest.raises(LoRAAdapterError, match="already names"):
        greedy(llm, case.prompts[:1], [reused])
    with pytest.raises(InvalidRequestError, match="lora_request"):
        greedy(llm, case.prompts[:2], [case.adapters[0]] * 3)
    # The engine goes on serving after every refusal.
    assert greedy(llm, case.prompts[:1], [case.adapters[0]]) == [[case.expected[1][0]]]
    assert_all_freed(llm)


def test_beam_search_runs_every_beam_with_the_adapter(case):
    from platform_core import BeamSearchParams

    llm = LLM(case.model_dir, dtype="float32", enable_lora=True, max_lora_rank=16)
    params = BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = [{"prompt_token_ids": case.prompts[1]}]
    adapter = case.adapters[1]
    # One beam is greedy decoding: PEFT's greedy tokens for the adapter.
    best = llm.beam_search(prompt, params, lora_request=adapter)[0].sequences[0]
    assert best.tokens[len(case.prompts[1]) :] == case.expected_for(adapter)[1]
    assert_all_freed(llm)


def test_an_adapter_gone_from_disk_fails_only_its_requests(case, tmp_path):
    import shutil

    copy = tmp_path / "vanishing"
    shutil.copytree(case.adapters[0].lora_path, copy)
    vanishing = LoRARequest("vanishing", 50, str(copy))
    llm = LLM(case.model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("gone", None, params, case.prompts[0], lora_request=vanishing)
    engine.add_request("kept", None, params, case.prompts[0], lora_request=case.adapters[1])
    shutil.rmtree(copy)  # after admission, before any step reads it
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["gone"].outputs[0].finish_reason == "error"
    assert "vanishing" in finished["gone"].error
    assert finished["kept"].outputs[0].token_ids == case.expected_for(case.adapters[1])[0]
    assert_all_freed(llm)
