"""The offline LLM API's housekeeping calls."""

from __future__ import annotations

from platform_core import LLM, SamplingParams


def test_reset_prefix_cache_through_the_llm(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory_bytes=1 << 22, block_size=16
    )
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    llm.generate(prompt, params, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert hits == 32  # two full 16-token blocks found the second time
    assert llm.reset_prefix_cache()
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits  # nothing found after the reset
