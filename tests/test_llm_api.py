"""The offline LLM API's housekeeping calls."""

from __future__ import annotations

import pytest
import torch

from platform_core import LLM, SamplingParams
from platform_core.kv_cache.block_pool import BlockPoolError


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


def test_requests_without_stream_report_only_when_finished(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory_bytes=1 << 22)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 20))
    engine.add_request("live", None, params, prompt_token_ids=prompt)
    engine.add_request("final", None, params, prompt_token_ids=prompt, stream=False)
    seen: dict[str, list] = {"live": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["live"]) == 6  # one output per generated token
    [final] = seen["final"]
    assert final.finished and final.metrics.first_token_time is not None
    # Same seed, same prompt: the unstreamed request ends exactly where the streamed one does.
    live_last = seen["live"][-1]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in live_last.outputs]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert llm.stats()["num_running"] == 0


def test_kv_cache_info_and_integrity_check_through_the_llm(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", num_gpu_blocks_override=12, block_size=16
    )
    info = llm.kv_cache_info()
    assert (info.num_blocks, info.block_size) == (12, 16)
    # K and V x 16 tokens x 2 KV heads x head size 16 x 4 bytes x 2 layers
    assert info.bytes_per_block == 2 * 16 * 2 * 16 * 4 * 2
    assert info.planned_bytes == 12 * info.bytes_per_block
    assert 0 < info.allocated_bytes <= info.planned_bytes
    assert info.devices == (torch.device("cpu"),)
    llm.generate({"prompt_token_ids": list(range(3, 40))}, use_tqdm=False)
    llm.check_kv_integrity()
    # A holder no block table accounts for: the check must notice.
    llm.engine.scheduler.kv.pool.ref_counts[0] += 1
    with pytest.raises(BlockPoolError):
        llm.check_kv_integrity()
