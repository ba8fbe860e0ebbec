"""Batch-1 decode on a quantized GGUF: kept quantized vs dequantized vs llama.cpp (issue #25).

Side by side in one run, on the same file and the same threads:

- platform-core with the GGUF's blocks kept (``quantization="gguf"``; activations in the
  ``--dtype`` the backend picks for ``auto``),
- platform-core dequantized at load time, in bfloat16 and in float32,
- llama.cpp through ``llama-cpp-python`` from the Python of ``--llama-cpp-python`` (a venv with
  it built: ``python -m venv /tmp/lcppenv && /tmp/lcppenv/bin/pip install llama-cpp-python``),
  on the same token ids with the end-of-sequence token banned.

For each: tokens/s of the decode steps (``(t(1 + N) - t(1)) / N`` over one ``--input-len``
prompt, median of ``--repeats``), the bytes a step reads (weights as held, plus the KV cache at
the mean context; llama.cpp: the file's tensor bytes) and that over the measured read bandwidth
(the ceiling), and the resident weights in MB.

    python benchmarks/quantized_decode.py [--gguf FILE] [--llama-cpp-python /tmp/lcppenv/bin/python]
        [--input-len 128] [--output-len 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from decode_bandwidth import cpu_model, generate_seconds, kv_bytes_per_token, read_bandwidth
from platform_core_cpu.isa import host_isa

from platform_core import LLM
from platform_core.models.packaged import DEFAULT_MODEL, locate_packaged_model

LLAMA_CPP_SCRIPT = """
import json, statistics, sys, time
from llama_cpp import Llama
path, threads, input_len, output_len, repeats = sys.argv[1], *map(int, sys.argv[2:6])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
            n_batch=512, verbose=False)
prompt = [(7 * i) % 1000 + 10 for i in range(input_len)]
ban = {llm.token_eos(): -1e9}
def seconds(tokens):
    llm.reset()
    started = time.perf_counter()
    llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, logit_bias=ban)
    return time.perf_counter() - started
seconds(output_len)
prefill = statistics.median(seconds(1) for _ in range(repeats))
whole = statistics.median(seconds(1 + output_len) for _ in range(repeats))
print(json.dumps({"step_s": (whole - prefill) / output_len}))
"""


@dataclass
class Row:
    """One engine's figures."""

    name: str
    step_s: float
    step_bytes: float
    weights_bytes: float


def measure_ours(gguf: Path, args: argparse.Namespace, **engine: object) -> Row:
    """Batch-1 decode steps of platform-core on ``gguf`` with ``engine`` keys."""
    llm = LLM(str(gguf), **engine)
    prompt = [(7 * i) % 1000 + 10 for i in range(args.input_len)]
    generate_seconds(llm, prompt, args.output_len)  # warm-up
    prefill = statistics.median(generate_seconds(llm, prompt, 1) for _ in range(args.repeats))
    whole = statistics.median(
        generate_seconds(llm, prompt, 1 + args.output_len) for _ in range(args.repeats)
    )
    runner = llm.engine.runner
    mean_context = args.input_len + (1 + args.output_len) / 2
    weights = runner.weights_bytes
    kv = kv_bytes_per_token(llm) * mean_context
    name = f"platform-core {runner.quantization or 'dequantized'} ({runner.dtype})"
    llm.shutdown()
    return Row(name, (whole - prefill) / args.output_len, weights + kv, weights)


def measure_llama_cpp(gguf: Path, python: str, args: argparse.Namespace, kv: float) -> Row:
    """The same decode through llama.cpp in ``python`` (its KV cache counted as ours)."""
    argv = [python, "-c", LLAMA_CPP_SCRIPT, str(gguf), str(torch.get_num_threads())]
    argv += [str(args.input_len), str(args.output_len), str(args.repeats)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
    step = json.loads(done.stdout.strip().splitlines()[-1])["step_s"]
    from gguf import GGUFReader

    weights = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)
    return Row("llama.cpp (llama-cpp-python, same file)", step, weights + kv, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the packaged SmolLM2")
    parser.add_argument("--llama-cpp-python", default=None, help="python of a llama-cpp venv")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gguf = args.gguf or locate_packaged_model(DEFAULT_MODEL)

    rows = [
        measure_ours(gguf, args, quantization="gguf"),
        measure_ours(gguf, args, dtype="bfloat16"),
        measure_ours(gguf, args, dtype="float32"),
    ]
    if args.llama_cpp_python:
        # llama.cpp keeps its KV cache in float16: the bf16 row's KV bytes
        kv = rows[1].step_bytes - rows[1].weights_bytes
        rows.append(measure_llama_cpp(gguf, args.llama_cpp_python, args, kv))
    bandwidth = read_bandwidth(1.0)
    quantized = rows[0]
    print(f"CPU: {cpu_model()}; {host_isa().describe()}; {torch.get_num_threads()} threads")
    print(f"model {gguf.name}; prompt {args.input_len} tokens, {args.output_len} decoded")
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("| engine | tok/s | ms/step | MB read/step | ceiling ms | of ceiling | weights MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ceiling = row.step_bytes / bandwidth
        print(
            f"| {row.name} | {1 / row.step_s:.1f} | {row.step_s * 1e3:.2f} | "
            f"{row.step_bytes / 1e6:.1f} | {ceiling * 1e3:.2f} | {ceiling / row.step_s:.0%} | "
            f"{row.weights_bytes / 1e6:.1f} |"
        )
    for row in rows[1:]:
        print(f"\nkept quantized vs {row.name}: {row.step_s / quantized.step_s:.2f}x tokens/s")


if __name__ == "__main__":
    main()
