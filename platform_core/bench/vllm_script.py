"""Run by path with another interpreter (a venv holding vLLM): time vLLM's offline ``LLM``.

``python vllm_script.py SPEC.json RESULT.json``. The spec holds the model, engine settings and
requests as token ids; the result holds vLLM's version, the timed seconds and the token counts.
Only the standard library and vllm are imported: platform-core is not installed there.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    """Load the model, warm up on one short request, then generate every request once."""
    import vllm
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enable_prefix_caching=spec["prefix_caching"],
        max_num_seqs=spec["max_num_seqs"],
        block_size=spec["block_size"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    llm.generate([{"prompt_token_ids": spec["warmup"]}], [params(4)], use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    sampling = [params(n) for n in spec["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = {
        "version": vllm.__version__,
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
