"""Workload flags shared by ``bench throughput`` and ``bench serve``, and the requests they name."""

from __future__ import annotations

import argparse

from platform_core.bench.workloads import (
    BenchRequest,
    LengthRange,
    TokenSpace,
    WorkloadError,
    load_jsonl,
    random_requests,
    shared_prefix_requests,
)

DEFAULT_NUM_PROMPTS = 64


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags choosing and shaping the request workload."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=("random", "shared-prefix", "jsonl"), default="random")
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"number of requests (default: {DEFAULT_NUM_PROMPTS}; jsonl: every line)",
    )
    group.add_argument(
        "--input-len",
        type=LengthRange.parse,
        default=LengthRange(128, 128),
        help="random: prompt length, N or LOW:HIGH (default: 128)",
    )
    group.add_argument(
        "--output-len",
        type=LengthRange.parse,
        default=LengthRange(128, 128),
        help="random, shared-prefix: output length, N or LOW:HIGH (default: 128)",
    )
    group.add_argument("--prefix-len", type=int, default=256, help="shared-prefix (default: 256)")
    group.add_argument("--suffix-len", type=int, default=32, help="shared-prefix (default: 32)")
    group.add_argument("--dataset-path", help="jsonl: file of requests")
    group.add_argument("--workload-seed", type=int, default=0, help="(default: 0)")
    group.add_argument(
        "--token-id-range",
        type=TokenSpace.parse,
        default=None,
        help="LOW:HIGH token ids for random prompts (default: the vocabulary minus special ids)",
    )


def build_workload(args: argparse.Namespace, tokens: TokenSpace | None) -> list[BenchRequest]:
    """The requests ``args`` describe; ``tokens`` is needed unless the workload is a file."""
    if args.workload == "jsonl":
        if not args.dataset_path:
            raise WorkloadError("--workload jsonl needs --dataset-path")
        return load_jsonl(args.dataset_path)[: args.num_prompts]
    tokens = args.token_id_range or tokens
    if tokens is None:
        raise WorkloadError(f"--workload {args.workload} needs --tokenizer or --token-id-range")
    num = args.num_prompts or DEFAULT_NUM_PROMPTS
    if args.workload == "shared-prefix":
        return shared_prefix_requests(
            num, args.prefix_len, args.suffix_len, args.output_len, tokens, args.workload_seed
        )
    return random_requests(num, args.input_len, args.output_len, tokens, args.workload_seed)
