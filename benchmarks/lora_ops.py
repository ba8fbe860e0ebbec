"""The CPU backend's ``lora_shrink`` and ``lora_expand`` (its compiled kernels and its torch path)
beside the core's reference ops, per call.

Projections of the shapes a LoRA'd model runs (SmolLM2-135M's q/k/v, gate/up and down, a 1B
model's q/k/v; ``--shapes``), four adapters loaded, in float32 and bfloat16, for decode-like
steps (``T`` tokens, each its own request, adapters in turn: slots ``t % 4``) and prefill-like
steps (a few segments of 128-512 tokens, one on the base model). Each cell is the best of
``--repeats`` rounds of calls (as many as fit in about ``--round-ms``; the two sides' rounds
alternate), in microseconds, for the reference, the torch path and the compiled kernels of the
level the backend runs; the ratios are reference / compiled and torch path / compiled (above 1:
the compiled kernel is faster):

    python benchmarks/lora_ops.py [--ranks 8,16,64] [--shapes smol-qkv,1b-qkv] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from platform_core_cpu.isa import host_isa
from platform_core_cpu.kernels import load_kernels
from platform_core_cpu.lora_ops import CpuLoRAOps

from platform_core.backend_api import LoRAMapping, LoRASegment, lora_expand, lora_shrink

ADAPTERS = 4
# name -> (input size, output slice sizes)
SHAPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "smol-qkv": (576, (576, 192, 192)),
    "smol-gate-up": (576, (1536, 1536)),
    "smol-down": (1536, (576,)),
    "1b-qkv": (2048, (2048, 512, 512)),
}
# name -> (start, end, slot) runs; tokens outside every run are the base model's
STEPS: dict[str, tuple[tuple[int, int, int], ...]] = {
    **{f"decode-{n}": tuple((t, t + 1, t % ADAPTERS) for t in range(n)) for n in (1, 8, 32, 64)},
    "prefill-512": ((0, 512, 1),),
    "prefill-mixed": ((0, 256, 0), (256, 768, 2), (896, 1152, 1)),  # 768-896: base model
}
STEP_TOKENS = {"prefill-mixed": 1152}


def mapping_for(runs: tuple[tuple[int, int, int], ...], tokens: int) -> LoRAMapping:
    """The step's mapping: ``runs`` as segments, -1 elsewhere."""
    slots = torch.full((tokens,), -1, dtype=torch.int32)
    for start, end, slot in runs:
        slots[start:end] = slot
    return LoRAMapping(slots, tuple(LoRASegment(*run) for run in runs), ADAPTERS)


def best_us(ops: tuple[Callable[[], object], ...], repeats: int, round_ms: float) -> list[float]:
    """Each op's fastest round's time per call, in microseconds (rounds of about ``round_ms``,
    the ops' rounds interleaved so that other load on the machine hits them alike)."""
    calls = []
    for op in ops:
        start = time.perf_counter()
        op()
        calls.append(max(1, int(round_ms / 1e3 / max(time.perf_counter() - start, 1e-6))))
    best = [float("inf")] * len(ops)
    for _ in range(repeats):
        for index, op in enumerate(ops):
            start = time.perf_counter()
            for _ in range(calls[index]):
                op()
            best[index] = min(best[index], (time.perf_counter() - start) / calls[index])
    return [seconds * 1e6 for seconds in best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--ranks", default="16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-ms", type=float, default=100.0)
    args = parser.parse_args()
    isa = host_isa()
    build = load_kernels(isa.level)
    if build.ops is None:
        raise SystemExit(f"the {isa.level} kernels did not build: {build.reason}")
    # One step's grouping is made on the first call and shared by the rest, as in the engine.
    torch_path, compiled = CpuLoRAOps(), CpuLoRAOps(build.ops)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{isa.describe()}; {args.threads} threads; {ADAPTERS} adapters loaded\n")
    print(
        "| shape | dtype | rank | step | shrink ref us | torch | compiled | ref/comp | torch/comp "
        "| expand ref us | torch | compiled | ref/comp | torch/comp |"
    )
    print("|---|---|---:|---|" + "---:|" * 10)
    for shape in args.shapes.split(","):
        inputs, slice_sizes = SHAPES[shape]
        parts, outputs = len(slice_sizes), sum(slice_sizes)
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            for rank in map(int, args.ranks.split(",")):
                lora_a = (torch.randn(ADAPTERS, parts, rank, inputs, generator=gen) / 30).to(dtype)
                lora_b = (torch.randn(ADAPTERS, outputs, rank, generator=gen) / 4).to(dtype)
                for step in args.steps.split(","):
                    runs = STEPS[step]
                    tokens = STEP_TOKENS.get(step, runs[-1][1])
                    mapping = mapping_for(runs, tokens)
                    x = torch.randn(tokens, inputs, generator=gen).to(dtype)
                    out = torch.randn(tokens, outputs, generator=gen).to(dtype)
                    buffer = lora_shrink(x, lora_a, mapping)
                    shrink_args = (x, lora_a, mapping)
                    # In place on one output: the adds only grow it, the time is the same.
                    expand_args = (out, buffer, lora_b, slice_sizes, mapping)
                    shrink = best_us(
                        tuple(
                            functools.partial(op, *shrink_args)
                            for op in (lora_shrink, torch_path.shrink, compiled.shrink)
                        ),
                        args.repeats,
                        args.round_ms,
                    )
                    expand = best_us(
                        tuple(
                            functools.partial(op, *expand_args)
                            for op in (lora_expand, torch_path.expand, compiled.expand)
                        ),
                        args.repeats,
                        args.round_ms,
                    )
                    cells = f"{_cells(shrink)} | {_cells(expand)}"
                    print(f"| {shape} | {str(dtype)[6:]} | {rank} | {step} | {cells} |")


def _cells(times: list[float]) -> str:
    """Reference, torch path and compiled times, then reference and torch path over compiled."""
    ref, torch_path, compiled = times
    return (
        f"{ref:.0f} | {torch_path:.0f} | {compiled:.0f} | {ref / compiled:.2f} | "
        f"{torch_path / compiled:.2f}"
    )


if __name__ == "__main__":
    main()
