"""Beam search with and without prefix caching: KV blocks held at the peak, tokens computed,
prefix-cache hits and wall time, on the seeded random Llama (``platform_core.bench.random_model``).

Beams share their prompt and common-prefix blocks through the prefix cache, so with it on the
peak should be about the prompt's blocks plus one block per beam, and the prompt computed once.

    python benchmarks/beam_sharing.py [--beam-width 4] [--prompt-len 64] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from platform_core import LLM, BeamSearchParams
from platform_core.bench.random_model import build_random_llama


def run(model: Path, caching: bool, args: argparse.Namespace) -> dict:
    """One beam search; the figures it cost."""
    llm = LLM(
        str(model),
        dtype="float32",
        block_size=16,
        kv_cache_memory_bytes=1 << 26,
        enable_prefix_caching=caching,
    )
    scheduler, peak = llm.engine.scheduler, 0
    schedule = scheduler.schedule

    def recording_schedule():  # the blocks in use right after each step's allocation
        nonlocal peak
        output = schedule()
        peak = max(peak, scheduler.kv_stats().num_used_blocks)
        return output

    scheduler.schedule = recording_schedule
    before, started = llm.stats(), time.perf_counter()
    params = BeamSearchParams(
        beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True
    )
    llm.beam_search({"prompt_token_ids": list(range(3, 3 + args.prompt_len))}, params)
    after = llm.stats()
    return {
        "peak_blocks": peak,
        "computed_tokens": after["num_scheduled_tokens"] - before["num_scheduled_tokens"],
        "hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        "wall_s": round(time.perf_counter() - started, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = build_random_llama(Path(folder) / "model")
        for caching in (True, False):
            print(f"prefix caching {'on ' if caching else 'off'}:", run(model, caching, args))


if __name__ == "__main__":
    main()
