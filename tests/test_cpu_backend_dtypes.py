"""A whole model on the CPU backend in every dtype it declares, at every ISA level this CPU runs
(``PLATFORM_CORE_CPU_ISA`` forces the lower ones), with chunked prefill and prefix caching on.

float32 must give HF transformers' greedy tokens exactly. bf16 rounds differently from HF's
float32 reference, so exact tokens would fail on near-ties of a random tiny model; instead
HF, teacher-forced on the engine's tokens, must rate each of them within a small margin of its
own best, and the engine's logprob of each must be close to HF's (a broken kernel picks tokens
HF rates far lower, or misjudges their probability).
"""

from __future__ import annotations

import pytest
import torch
from platform_core_cpu.isa import ISA_ENV, host_isa
from platform_core_cpu.plugin import capabilities

from platform_core import LLM, SamplingParams
from tests.test_generate_vs_hf import hf_greedy, make_prompts, shared_prefix_prompts

MAX_TOKENS = 10
# bf16 against HF float32: how much below HF's best a chosen token may be, and how far the
# engine's logprob of it may be from HF's (nats; the tiny model's logits span a few units).
BF16_CHOICE_MARGIN = 0.15
BF16_LOGPROB_ATOL = 0.15


@pytest.fixture(scope="module")
def case(tiny_model_dir, hf_reference_model):
    prompts = [*make_prompts([1, 9, 33, 140], seed=11), *shared_prefix_prompts(seed=12)[:2]]
    model = hf_reference_model("llama")
    return {
        "dir": str(tiny_model_dir("llama")),
        "model": model,
        "prompts": prompts,
        "expected": hf_greedy(model, prompts, MAX_TOKENS),
    }


def _run(case, dtype: str):
    llm = LLM(
        case["dir"],
        dtype=dtype,
        backend="cpu",
        block_size=16,
        max_num_batched_tokens=48,  # the 140-token prompt prefills in chunks
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in case["prompts"]], params, use_tqdm=False
    )
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    llm.check_kv_integrity()
    return llm, [o.outputs[0] for o in outputs]


@torch.inference_mode()
def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's float32 log-probabilities ``[len(tokens), vocab]`` at each generated position."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("dtype", capabilities().dtypes)
@pytest.mark.parametrize("level", host_isa().supported)
def test_whole_model_in_each_dtype_at_each_level(case, monkeypatch, level, dtype):
    monkeypatch.setenv(ISA_ENV, level)
    llm, outputs = _run(case, dtype)
    backend = llm.engine.backend
    assert backend.isa.level == level and backend.attention.kernel == "compiled"
    assert {p.dtype for p in llm.engine.runner.model.parameters()} == {getattr(torch, dtype)}
    if dtype == "float32":
        assert [o.token_ids for o in outputs] == case["expected"]
        return
    for p, (prompt, output) in enumerate(zip(case["prompts"], outputs, strict=True)):
        hf = _hf_logprobs(case["model"], prompt, output.token_ids)
        assert torch.isfinite(hf).all()
        for k, token in enumerate(output.token_ids):
            engine_logprob = output.logprobs[k][token].logprob
            best, chosen = hf[k].max().item(), hf[k, token].item()
            where = f"prompt {p}, token {k} ({level}, {dtype})"
            assert chosen >= best - BF16_CHOICE_MARGIN, (
                f"{where}: HF rates it {chosen:.3f} < {best:.3f}"
            )
            assert abs(engine_logprob - chosen) < BF16_LOGPROB_ATOL, (
                f"{where}: engine logprob {engine_logprob:.3f} vs HF {chosen:.3f}"
            )
