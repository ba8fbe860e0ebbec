"""``platform-core bench throughput|latency|serve``: flags, runs, printed and saved results.

``add_bench_parser(subparsers)`` adds the ``bench`` command to the main parser; each leaf sets
``func(args) -> exit code``. Throughput and latency take every engine flag (``add_engine_args``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from typing import Any

from platform_core.bench.report import print_rows, save_result, stat_rows
from platform_core.bench.workload_args import add_workload_args, build_workload
from platform_core.bench.workloads import TokenSpace, WorkloadError
from platform_core.entrypoints.engine_args import add_engine_args, engine_config_from_args


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _build_llm(args: argparse.Namespace) -> tuple[Any, TokenSpace]:
    from platform_core.entrypoints.llm import LLM

    llm = LLM(config=engine_config_from_args(args))
    tokens = args.token_id_range or TokenSpace.from_tokenizer(llm.tokenizer, llm.engine.vocab_size)
    return llm, tokens


def cmd_throughput(args: argparse.Namespace) -> int:
    """Run the throughput benchmark and print requests/s and tokens/s."""
    from platform_core.bench.throughput import run_throughput, warm_up

    llm, tokens = _build_llm(args)
    requests = build_workload(args, tokens)
    warm_up(llm, tokens, args.num_warmup_requests)
    result = run_throughput(llm, requests, args.temperature, args.ignore_eos)
    print_rows(
        "Throughput",
        [
            ("Requests", result.num_requests),
            ("Elapsed (s)", result.elapsed_s),
            ("Prompt tokens", result.prompt_tokens),
            ("Output tokens", result.output_tokens),
            ("Requests/s", result.requests_per_s),
            ("Total tokens/s", result.total_tokens_per_s),
            ("Output tokens/s", result.output_tokens_per_s),
            ("Engine steps", result.num_steps),
            ("Preemptions", result.num_preemptions),
            ("Prefix cache hit rate", result.prefix_cache_hit_rate),
            ("KV waste mean", result.kv_waste_mean),
            ("KV waste max", result.kv_waste_max),
            ("Spec proposed tokens", result.spec_proposed_tokens),
            ("Spec accepted tokens", result.spec_accepted_tokens),
            ("Spec acceptance rate", result.spec_acceptance_rate),
            ("Spec mean accepted length", result.spec_mean_accepted_length),
        ],
    )
    if args.save_result:
        save_result(args.save_result, "throughput", _settings(args), result.to_dict())
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    """Run the latency benchmark and print mean and percentile latencies."""
    from platform_core.bench.latency import run_latency

    llm, tokens = _build_llm(args)
    result = run_latency(
        llm,
        args.batch_size,
        args.input_len,
        args.output_len,
        tokens,
        args.num_iters_warmup,
        args.num_iters,
        args.workload_seed,
    )
    print_rows(
        f"Latency (batch {args.batch_size}, input {args.input_len}, output {args.output_len})",
        stat_rows("latency", result.summary(), "s"),
    )
    if args.save_result:
        save_result(args.save_result, "latency", _settings(args), result.to_dict())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Load a running server and print throughput, TTFT/TPOT/ITL/E2E, goodput and what the
    servers' KV connectors moved meanwhile."""
    from platform_core.bench.kv_metrics import KVTransferWatch
    from platform_core.bench.metrics import parse_goodput, serve_metrics
    from platform_core.bench.serve import ServeConfig, run_serve

    slo = parse_goodput(args.goodput or [])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    tokens = None
    if args.tokenizer:
        from platform_core.models.hf_files import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer is None:
            raise WorkloadError(f"no tokenizer could be loaded from {args.tokenizer}")
        tokens = TokenSpace.from_tokenizer(tokenizer, len(tokenizer))
    requests = build_workload(args, tokens)
    config = ServeConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.workload_seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    kv_watch = KVTransferWatch(args.kv_metrics_url or [args.base_url], config.headers)
    records, duration = asyncio.run(run_serve(config, requests))
    kv_deltas = kv_watch.deltas()
    metrics = serve_metrics(records, duration, args.percentiles, slo)
    rows: list[tuple[str, Any]] = [
        ("Successful requests", metrics["completed"]),
        ("Failed requests", metrics["failed"]),
        ("Duration (s)", duration),
        ("Total input tokens", metrics["total_input_tokens"]),
        ("Total output tokens", metrics["total_output_tokens"]),
        ("Request throughput (req/s)", metrics["request_throughput"]),
        ("Output token throughput (tok/s)", metrics["output_throughput"]),
        ("Total token throughput (tok/s)", metrics["total_token_throughput"]),
    ]
    if slo:
        rows.append((f"Goodput (req/s) {slo}", metrics["goodput"]))
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        rows += stat_rows(name, metrics[key], "ms")
    print_rows("Serving benchmark", rows)
    for url, delta in kv_deltas.items():
        if delta is not None:
            print_rows(f"KV transfer ({url})", delta.rows())
        elif args.kv_metrics_url:
            print(f"no KV-transfer metrics at {url}/metrics")
    for error in metrics["errors"]:
        print(f"error: {error}")
    if any(kv_deltas.values()):
        metrics["kv_transfer"] = {u: d.to_dict() for u, d in kv_deltas.items() if d is not None}
    if args.save_result:
        save_result(args.save_result, "serve", _settings(args), metrics)
    return 0 if metrics["completed"] else 1


def _percentiles(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` with ``throughput``, ``latency`` and ``serve`` to a subparsers object."""
    bench = subparsers.add_parser("bench", help="measure throughput, latency, or a live server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    throughput = kinds.add_parser("throughput", help="offline LLM.generate over a workload")
    add_workload_args(throughput)
    throughput.add_argument("--temperature", type=float, default=0.0, help="(default: greedy)")
    throughput.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    throughput.add_argument("--num-warmup-requests", type=int, default=2)
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_throughput)

    latency = kinds.add_parser("latency", help="latency of one fixed batch, with percentiles")
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters-warmup", type=int, default=2)
    latency.add_argument("--num-iters", type=int, default=10)
    latency.add_argument("--workload-seed", type=int, default=0)
    latency.add_argument("--token-id-range", type=TokenSpace.parse, default=None)
    add_engine_args(latency)
    latency.set_defaults(func=cmd_latency)

    serve = kinds.add_parser("serve", help="stream completions from an OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--endpoint", default="/v1/completions")
    serve.add_argument("--model", required=True, help="model name sent in each request")
    serve.add_argument(
        "--tokenizer", help="local HF tokenizer dir (random prompts avoid its special tokens)"
    )
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: inf, all at once)",
    )
    serve.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="SLOs, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)",
    )
    serve.add_argument(
        "--percentiles",
        type=_percentiles,
        default=[99.0],
        help="comma-separated percentiles to report (default: 99)",
    )
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    serve.add_argument(
        "--kv-metrics-url",
        nargs="+",
        metavar="URL",
        help="servers whose KV-transfer metrics (/metrics) are reported as differences over the "
        "run, e.g. the prefill and decode instances behind a proxy (default: --base-url; "
        "nothing is reported for a server without a KV connector)",
    )
    add_workload_args(serve)
    serve.set_defaults(func=cmd_serve)

    for command in (throughput, latency, serve):
        command.add_argument("--save-result", metavar="FILE", help="write the result as JSON")
