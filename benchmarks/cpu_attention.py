"""Compare the CPU backend's attention paths: compiled kernel, torch fallback, reference.

Usage: ``python benchmarks/cpu_attention.py [--threads N] [--block-size 16] [--repeats 5]``
(with ``platform_core`` and ``platform_core_cpu`` importable). Two workloads, head size 64 with 8
query / 4 KV heads in bfloat16: a decode batch of 32 sequences with 512 tokens of context each,
and one 512-token prefill. Block tables are shuffled so blocks are scattered in the cache. The
first build of the compiled kernel is timed separately (it is cached across runs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from platform_core_cpu.attention import CpuAttentionOps
from platform_core_cpu.kernels import load_kernels

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import reference_paged_attention

HEADS, KV_HEADS, HEAD_SIZE, DTYPE = 8, 4, 64, torch.bfloat16
WORKLOADS = {
    "decode 32 x ctx 512": [(512, 1)] * 32,
    "prefill 512": [(512, 512)],
}


def build(
    specs: list[tuple[int, int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query, canonical-layout cache and metadata for ``(seq_len, query_len)`` sequences."""
    gen = torch.Generator().manual_seed(0)
    counts = [-(-seq_len // block_size) for seq_len, _ in specs]
    order = torch.randperm(sum(counts), generator=gen).int()
    tables = torch.zeros(len(specs), max(counts), dtype=torch.int32)
    for i, used in enumerate(torch.tensor(counts).cumsum(0).tolist()):
        tables[i, : counts[i]] = order[used - counts[i] : used]
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    lens = [seq_len for seq_len, _ in specs]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(lens),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    shape = (2, sum(counts), block_size, KV_HEADS, HEAD_SIZE)
    cache = torch.randn(shape, generator=gen).to(DTYPE)
    query = torch.randn(starts[-1], HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
    return query, cache, metadata


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def compare(name: str, specs: list[tuple[int, int]], block_size: int, repeats: int) -> None:
    """Time the three paths on one workload and print the times and the ratios."""
    query, canonical, metadata = build(specs, block_size)
    cache = canonical.transpose(2, 3).contiguous()  # the backend's per-head layout
    scale = HEAD_SIZE**-0.5
    compiled, fallback = CpuAttentionOps("compiled"), CpuAttentionOps("torch")
    fast = best_ms(lambda: compiled.forward(query, cache, metadata, scale), repeats)
    torch_ms = best_ms(lambda: fallback.forward(query, cache, metadata, scale), repeats)
    ref_ms = best_ms(lambda: reference_paged_attention(query, canonical, metadata, scale), repeats)
    print(
        f"{name:20s} compiled {fast:7.2f} ms | torch fallback {torch_ms:7.2f} ms "
        f"({torch_ms / fast:4.1f}x) | reference {ref_ms:7.2f} ms ({ref_ms / fast:4.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build_result = load_kernels()
    if build_result.ops is None:
        raise SystemExit(f"compiled kernel unavailable: {build_result.reason}")
    print(f"kernel build/load: {build_result.seconds:.1f} s (cached after the first build)")
    print(f"threads={args.threads} block_size={args.block_size} bfloat16 head={HEAD_SIZE}")
    for name, specs in WORKLOADS.items():
        compare(name, specs, args.block_size, args.repeats)


if __name__ == "__main__":
    main()
