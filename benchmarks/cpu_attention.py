"""Compare the CPU backend's attention paths: compiled kernel, torch fallback, reference.

Usage: ``python benchmarks/cpu_attention.py [--threads N] [--block-size 16] [--repeats 5]
[--dtype bfloat16|float32]`` (with ``platform_core`` and ``platform_core_cpu`` importable). Five
workloads, head size 64 with 8 query / 4 KV heads: decode batches (32 sequences of 512 tokens;
64 of 40-607), one 512-token prefill, two prefill chunks beside 60 decodes, and the last
2048-token chunk of a 4096-token prompt. Block tables are
shuffled so blocks are scattered in the cache. The first build of the compiled kernel is timed
separately (it is cached across runs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from attention_batches import AttentionShape, build
from platform_core_cpu.attention import CpuAttentionOps, key_tokens, value_tokens
from platform_core_cpu.isa import host_isa
from platform_core_cpu.kernels import load_kernels

from platform_core.attention.reference import reference_paged_attention

HEADS, KV_HEADS, HEAD_SIZE = 8, 4, 64
WORKLOADS = {
    "decode 32 x ctx 512": [(512, 1)] * 32,
    "decode 64 x ctx 40-607": [(40 + 9 * i, 1) for i in range(64)],
    "prefill 512": [(512, 512)],
    "2 prefills + 60 decodes": [(300, 200), (500, 256)] + [(40 + 9 * i, 1) for i in range(60)],
    "prefill chunk 2048 of 4096": [(4096, 2048)],
}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def cpu_layout(canonical: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reference-layout cache ``canonical`` copied into the CPU backend's tiles."""
    _, num_blocks, _, kv_heads, head_size = canonical.shape
    shape = CpuAttentionOps("torch").kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
    cache = torch.empty(shape, dtype=canonical.dtype)
    keys, values = key_tokens(cache[0], head_size), value_tokens(cache[1], head_size)
    keys.copy_(canonical[0].transpose(1, 2).unflatten(-1, (head_size // 2, 2)))
    values.copy_(canonical[1].transpose(1, 2).unflatten(2, (block_size // 2, 2)))
    return cache


def compare(
    name: str, specs: list[tuple[int, int]], shape: AttentionShape, block_size: int, repeats: int
) -> None:
    """Time the three paths on one workload and print the times and the ratios."""
    query, canonical, metadata = build(specs, block_size, shape)
    cache = cpu_layout(canonical, block_size)
    scale = shape.head_size**-0.5
    compiled, fallback = CpuAttentionOps("compiled"), CpuAttentionOps("torch")
    fast = best_ms(lambda: compiled.forward(query, cache, metadata, scale), repeats)
    torch_ms = best_ms(lambda: fallback.forward(query, cache, metadata, scale), repeats)
    ref_ms = best_ms(lambda: reference_paged_attention(query, canonical, metadata, scale), repeats)
    print(
        f"{name:24s} compiled {fast:7.2f} ms | torch fallback {torch_ms:7.2f} ms "
        f"({torch_ms / fast:4.1f}x) | reference {ref_ms:7.2f} ms ({ref_ms / fast:4.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = host_isa()  # PLATFORM_CORE_CPU_ISA=avx2 measures the AVX2 build
    build_result = load_kernels(isa.level)
    if build_result.ops is None:
        raise SystemExit(f"compiled kernel unavailable: {build_result.reason}")
    print(f"kernel build/load: {build_result.seconds:.1f} s (cached after the first build)")
    print(isa.describe())
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_SIZE, getattr(torch, args.dtype))
    print(f"threads={args.threads} block_size={args.block_size} {args.dtype} head={HEAD_SIZE}")
    for name, specs in WORKLOADS.items():
        compare(name, specs, shape, args.block_size, args.repeats)


if __name__ == "__main__":
    main()
