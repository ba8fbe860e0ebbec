"""Decode bandwidth of the shared Triton paged-attention kernel on one GPU.

Usage: ``python benchmarks/gpu_attention.py [--device cuda] [--block-size 16]``. Decode batches
(one query token per sequence, 32 query / 8 KV heads, head size 128, bfloat16) over scattered
paged caches. For each the report gives the kernel's time, the bytes it must read (K and V of
every sequence, plus the queries and outputs) per second, and that as a share of two baselines
run side by side: the device's copy bandwidth (read + write of a 4 GiB buffer, the practical
HBM ceiling) and torch's ``scaled_dot_product_attention`` over the same keys laid out
contiguously (no paging). ``--sweep`` also times other launch settings of the kernel, each
output checked against the reference attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from attention_batches import AttentionShape, build

from platform_core.attention.reference import reference_paged_attention
from platform_core.kernels.triton.launch import LaunchParams
from platform_core.kernels.triton.ops import TritonAttentionOps

SHAPE = AttentionShape(heads=32, kv_heads=8, head_size=128, dtype=torch.bfloat16)
WORKLOADS = {  # name: (sequences, context)
    "decode 256 x ctx 1024": (256, 1024),
    "decode 64 x ctx 4096": (64, 4096),
    "decode 16 x ctx 16384": (16, 16384),
    "decode 1 x ctx 65536": (1, 65536),
}


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median time of ``repeats`` calls measured with device events, after three warm-ups."""
    for _ in range(3):
        fn()
    module = getattr(torch, device.type)
    times = []
    for _ in range(repeats):
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a device-to-device copy of 4 GiB."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats=10)
    return 2 * src.numel() / (ms / 1e3)


def sdpa_baseline(query: torch.Tensor, seqs: int, context: int) -> Callable[[], torch.Tensor]:
    """SDPA over contiguous ``[seqs, kv_heads, context, head]`` keys and values."""
    q = query.view(seqs, SHAPE.heads, 1, SHAPE.head_size)
    k, v = (
        torch.randn(seqs, SHAPE.kv_heads, context, SHAPE.head_size, device=q.device, dtype=q.dtype)
        for _ in range(2)
    )
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def measure(
    name: str,
    seqs: int,
    context: int,
    ops: TritonAttentionOps,
    block_size: int,
    ceiling: float,
    device: torch.device,
) -> None:
    """Time the kernel and the SDPA baseline on one decode batch and print the rates."""
    query, cache, metadata = build([(context, 1)] * seqs, block_size, SHAPE, device)
    scale = SHAPE.head_size**-0.5
    kernel_ms = time_ms(lambda: ops.forward(query, cache, metadata, scale), device)
    sdpa_ms = time_ms(sdpa_baseline(query, seqs, context), device)
    element = cache.element_size()
    kv_bytes = 2 * seqs * context * SHAPE.kv_heads * SHAPE.head_size * element
    io_bytes = 2 * query.numel() * element
    rate = (kv_bytes + io_bytes) / (kernel_ms / 1e3)
    print(
        f"{name:24s} triton {kernel_ms * 1e3:8.1f} us  {rate / 1e9:6.0f} GB/s "
        f"({rate / ceiling:4.0%} of copy) | sdpa contiguous {sdpa_ms * 1e3:8.1f} us "
        f"(triton / sdpa time {kernel_ms / sdpa_ms:4.2f})"
    )


def sweep(base: LaunchParams, block_size: int, device: torch.device) -> None:
    """Time launch settings around ``base`` on every workload, each checked against the
    reference attention; print the fastest three."""
    scale = SHAPE.head_size**-0.5
    grid = itertools.product((64, 128), (4, 8), (2, 3), (16, 64))
    candidates = [
        dataclasses.replace(base, block_n=n, num_warps=w, num_stages=s, max_splits=m)
        for n, w, s, m in grid
    ]
    for name, (seqs, context) in WORKLOADS.items():
        query, cache, metadata = build([(context, 1)] * seqs, block_size, SHAPE, device)
        expected = reference_paged_attention(query, cache, metadata, scale)
        timings = []
        for params in candidates:
            ops = TritonAttentionOps(params)
            run = functools.partial(ops.forward, query, cache, metadata, scale)
            torch.testing.assert_close(run(), expected, atol=2e-2, rtol=2e-2)
            ms = time_ms(run, device, repeats=10)
            label = (
                f"block_n={params.block_n} warps={params.num_warps} "
                f"stages={params.num_stages} max_splits={params.max_splits}"
            )
            timings.append((ms, label))
        best = ", ".join(f"{label}: {ms * 1e3:.1f} us" for ms, label in sorted(timings)[:3])
        print(f"sweep {name:24s} {best}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also time other launch settings")
    args = parser.parse_args()
    device = torch.device(args.device)
    props = getattr(torch, device.type).get_device_properties(device)
    launch = None
    if device.type == "cuda":
        from platform_core_cuda.plugin import cuda_launch_params

        launch = cuda_launch_params(props.multi_processor_count)
    ops = TritonAttentionOps(launch)
    ceiling = copy_bandwidth(device)
    print(f"{props.name}: copy bandwidth {ceiling / 1e9:.0f} GB/s (read + write)")
    for name, (seqs, context) in WORKLOADS.items():
        measure(name, seqs, context, ops, args.block_size, ceiling, device)
    if args.sweep and launch is not None:
        sweep(launch, args.block_size, device)


if __name__ == "__main__":
    main()
