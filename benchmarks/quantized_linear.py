"""The CPU backend's ``quantized_linear`` per call, beside its linear on bf16 weights.

One weight of a format at one shape (default: SmolLM2's gate/up projection, 3072 x 576, in
Q4_1), random blocks, bf16 activations of each row count; the best of ``--repeats`` rounds of
``--calls`` calls, in microseconds, on the kernel build of this CPU's level (or ``--level``).
The bf16 side is what a bf16 model runs on this backend (``CpuLinear``: oneDNN on packed
weights where this CPU's oneDNN has bf16, else the compiled kernel):

    python benchmarks/quantized_linear.py [--rows 1,8,16,64,512] [--format Q4_1] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from platform_core_cpu.isa import host_isa
from platform_core_cpu.kernels import load_kernels
from platform_core_cpu.linear import CpuLinear, packed_linear_available

from platform_core.backend_api import QUANT_FORMATS, random_blocks


def best_us(call: Callable[[], object], calls: int, repeats: int) -> float:
    """The fastest round's time per call, in microseconds."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,33,64,128,512")
    parser.add_argument("--format", default="Q4_1", choices=sorted(QUANT_FORMATS))
    parser.add_argument("--out-features", type=int, default=3072)
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--level", default=None, help="kernel build (default: this CPU's)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    level = args.level or host_isa().level
    build = load_kernels(level)
    if build.ops is None:
        raise SystemExit(f"the {level} kernels did not build: {build.reason}")
    fmt = QUANT_FORMATS[args.format]
    gen = torch.Generator().manual_seed(0)
    n, k = args.out_features, args.in_features
    blocks = random_blocks(n, k, fmt, 0.05, gen)
    dense = torch.randn(n, k, generator=gen).bfloat16()
    linear = CpuLinear(
        build.ops.linear_bf16, onednn=host_isa().onednn_bf16 and packed_linear_available()
    )
    print(f"{host_isa().describe()}; build {level}; {args.threads} threads")
    print(f"{args.format} [{n} x {k}], bf16 activations; bf16 linear: {linear.path}\n")
    print("| rows | quantized_linear us | bf16 linear us | ratio |")
    print("|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        ours = best_us(
            lambda x=x: build.ops.quantized_linear(x, blocks, fmt.name, None),
            args.calls,
            args.repeats,
        )
        theirs = best_us(lambda x=x: linear(x, dense), args.calls, args.repeats)
        print(f"| {rows} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
