"""Batch-1 decode against the memory-bandwidth ceiling on this CPU (issue #28).

A decode step at batch 1 reads every weight once (the tied embedding in full, as the LM head)
and the sequence's KV cache, so its time is bounded below by those bytes over the bandwidth a
plain read of a large buffer gets on the same threads. Reported side by side, in one run:

- bytes read per step: the model's parameters (``ModelRunner.weights_bytes``: a tied embedding
  once) plus the KV cache at the mean context of the decode;
- measured bandwidth: ``torch.sum`` over a ``--buffer-gib`` fp32 buffer (best of five), all of
  torch's threads, the same threads the engine uses;
- the ceiling step time (bytes / bandwidth), the measured step time, and their ratio;
- the CPU's features and the kernel level the backend chose (``PLATFORM_CORE_CPU_ISA`` etc.
  force a lower one).

The step time is ``(t(1 + N tokens) - t(1 token)) / N`` for one prompt of ``--input-len`` token
ids, ``N = --output-len``, median of ``--repeats`` runs.

    python benchmarks/decode_bandwidth.py [--model DIR] [--dtype bfloat16|float32]
        [--input-len 128] [--output-len 128] [--repeats 3] [--buffer-gib 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from platform_core_cpu.isa import host_isa

from platform_core import LLM, SamplingParams


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (the machine type where it has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def read_bandwidth(gib: float, repeats: int = 5) -> float:
    """Bytes per second ``torch.sum`` reads from a ``gib`` GiB fp32 buffer (best run)."""
    buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buffer.sum()  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best


def kv_bytes_per_token(llm: LLM) -> float:
    """Bytes of keys and values one token adds over all layers."""
    runner = llm.engine.runner
    return runner.bytes_per_block / runner.block_size


def generate_seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Wall seconds to generate ``tokens`` tokens (greedy, no early stop) after ``prompt``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer-gib", type=float, default=1.0)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype)
    prompt = [(7 * i) % 1000 + 10 for i in range(args.input_len)]
    generate_seconds(llm, prompt, args.output_len)  # warm-up: kernels, packed weights
    prefill = statistics.median(generate_seconds(llm, prompt, 1) for _ in range(args.repeats))
    whole = statistics.median(
        generate_seconds(llm, prompt, 1 + args.output_len) for _ in range(args.repeats)
    )
    step = (whole - prefill) / args.output_len

    weights = llm.engine.runner.weights_bytes
    mean_context = args.input_len + (1 + args.output_len) / 2
    per_step = weights + kv_bytes_per_token(llm) * mean_context
    bandwidth = read_bandwidth(args.buffer_gib)
    ceiling = per_step / bandwidth
    print(f"CPU: {cpu_model()}; {host_isa().describe()}")
    print(f"torch threads: {torch.get_num_threads()}; dtype {args.dtype}")
    print(
        f"bytes read per step: {per_step / 1e6:.1f} MB "
        f"(weights {weights / 1e6:.1f} MB, KV at mean context {mean_context:.0f})"
    )
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum over {args.buffer_gib} GiB)")
    print(f"ceiling step: {ceiling * 1e3:.2f} ms; measured step: {step * 1e3:.2f} ms")
    print(
        f"decode at {ceiling / step:.0%} of the bandwidth ceiling "
        f"({per_step / step / 1e9:.1f} GB/s effective)"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
