"""Running the real engine (``LLM``) on the backend under test, for the engine-level checks."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from platform_core import LLM, SamplingParams
from platform_core_conformance.context import ConformanceContext
from platform_core_conformance.generation import Generation

E2E_MAX_TOKENS = 8
MAX_NUM_SEQS = 8
# Small limits keep the profiled KV cache and the dummy profiling forward small.
ENGINE_DEFAULTS: dict[str, Any] = {
    "max_model_len": 512,
    "skip_tokenizer_init": True,
    "enable_prefix_caching": False,
}


def make_llm(context: ConformanceContext, model_dir: Path, **overrides: Any) -> LLM:
    """An ``LLM`` on the backend under test: float32 unless undeclared (then the first declared
    dtype), chunked prefill only where it is declared."""
    caps = context.capabilities
    defaults = {
        "dtype": "float32" if "float32" in caps.dtypes else caps.dtypes[0],
        "enable_chunked_prefill": "chunked_prefill" in caps.features,
        "max_num_seqs": min(MAX_NUM_SEQS, caps.max_batch or MAX_NUM_SEQS),
    }
    kwargs = {**ENGINE_DEFAULTS, **defaults, **overrides}
    return LLM(str(model_dir), backend=context.name, **kwargs)


def generate_greedy(
    llm: LLM, prompts: list[list[int]], max_tokens: int, n: int = 1
) -> list[Generation]:
    """``n`` greedy completions of every prompt (in prompt order) with each token's logprob; EOS
    is blocked (``min_tokens``), so every request runs to ``max_tokens``."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0, n=n
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    generations = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert len(output.outputs) == n, f"prompt {index}: {len(output.outputs)} completions"
        for completion in output.outputs:
            assert completion.finish_reason == "length", completion.finish_reason
            tokens = list(completion.token_ids)
            logprobs = [at[token].logprob for at, token in zip(completion.logprobs, tokens)]
            generations.append(Generation(index, prompt, tokens, logprobs))
    return generations


def assert_all_freed(llm: LLM) -> None:
    """After every request finished, no KV block may still be in use."""
    llm.check_kv_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, f"{stats['kv_blocks_used']} KV blocks still in use"


def kv_cache_bytes(llm: LLM) -> int:
    """Bytes of the KV-cache tensors the engine allocated in the backend's layout."""
    return llm.kv_cache_info().allocated_bytes


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the distinct storages of live Python-visible tensors on ``device``'s type."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type() rather than isinstance(): no __class__ lookups on arbitrary (proxy) objects.
        if not (issubclass(type(obj), torch.Tensor) and obj.device.type == device.type):
            continue
        if obj.is_mkldnn:  # opaque oneDNN tensors (packed weights) have no storage to share
            storages[-id(obj)] = obj.numel() * obj.element_size()
            continue
        storage = obj.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
