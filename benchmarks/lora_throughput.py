"""Multi-LoRA: throughput with adapters mixed across a batch vs the base model alone (#24).

Side by side in one process, on the default model (SmolLM2-135M-Instruct) unless ``--model``:

- ``--requests`` chat prompts submitted at once, each generating exactly ``--max-tokens``
  tokens (``ignore_eos``), three ways: the base model on an engine without LoRA; the same
  engine with ``--adapters`` random rank-``--rank`` adapters (all seven projections) spread
  round-robin over the requests (``max_loras`` = the number of adapters, so all share every
  step); and base-model requests on the LoRA engine (what enabling LoRA costs requests that use
  none). ``--rounds`` rounds, the order rotating, output tokens/s of each and the ratios;
- adapter load time: reading one adapter from disk, and writing it into a layer slot.

The adapters are written here in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), seeded, at a scale that changes the model's tokens.

    python benchmarks/lora_throughput.py [--requests 64] [--max-tokens 128] [--rounds 3]
        [--adapters 4] [--rank 16] [--model PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from platform_core import LLM, LoRARequest, SamplingParams
from platform_core.entrypoints.chat_template import render_chat
from platform_core.lora.peft_adapter import TARGET_MODULES, load_adapter, target_shapes

TOPICS = ["the sea", "a city", "winter", "a library", "the moon", "a garden", "trains", "rain"]


def write_adapter(path: Path, hf_config: Any, rank: int, seed: int) -> None:
    """A random PEFT adapter over every target module of every layer."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name, shape in target_shapes(hf_config).items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
            a = torch.randn(rank, shape.in_features, generator=generator) / shape.in_features**0.5
            b = 0.05 * torch.randn(shape.out_features, rank, generator=generator)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def prompts(llm: LLM, count: int) -> list[dict]:
    """Chat prompts as token ids."""
    tokenizer = llm.get_tokenizer()
    return [
        {
            "prompt_token_ids": render_chat(
                tokenizer,
                [{"role": "user", "content": f"Write a short poem about {TOPICS[i % 8]}."}],
                True,
                None,
            )
        }
        for i in range(count)
    ]


def throughput(
    llm: LLM, batch: list[dict], params: SamplingParams, loras: list[LoRARequest | None] | None
) -> float:
    """Output tokens/s of one batch."""
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def load_times(llm: LLM, adapter: LoRARequest, repeats: int = 5) -> tuple[float, float]:
    """Median milliseconds to read ``adapter`` from disk and to write it into a slot."""
    engine = llm.llm_engine
    worker = engine.runner.lora
    reads, writes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        loaded = load_adapter(adapter, engine.hf_config, engine.config.lora.max_lora_rank)
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        worker._write(0, loaded)
        writes.append(time.perf_counter() - started)
    return statistics.median(reads) * 1e3, statistics.median(writes) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    base = LLM(args.model, dtype=args.dtype)
    lora = LLM(
        args.model,
        dtype=args.dtype,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = []
    for i in range(1, args.adapters + 1):
        write_adapter(root / f"a{i}", lora.llm_engine.hf_config, args.rank, seed=i)
        adapters.append(LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    batch = prompts(base, args.requests)
    mixed = [adapters[i % len(adapters)] for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {
        "base": lambda: throughput(base, batch, params, None),
        "mixed adapters": lambda: throughput(lora, batch, params, mixed),
        "base on LoRA engine": lambda: throughput(lora, batch, params, None),
    }
    throughput(lora, batch[:8], params, mixed[:8])  # warm up (adapters read, kernels built)
    throughput(base, batch[:8], params, None)
    results: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(args.rounds):
        order = names[round_index % 3 :] + names[: round_index % 3]
        for name in order:
            results[name].append(runs[name]())
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{name} {results[name][-1]:.1f} tok/s" for name in names)
            + f"; mixed/base {results['mixed adapters'][-1] / results['base'][-1]:.2f}"
        )
    for name in names:
        print(f"{name}: median {statistics.median(results[name]):.1f} tok/s")
    ratios = [m / b for m, b in zip(results["mixed adapters"], results["base"], strict=True)]
    print(f"mixed adapters / base: {', '.join(f'{r:.2f}' for r in ratios)}")
    read_ms, write_ms = load_times(lora, adapters[0])
    print(f"adapter load: read {read_ms:.1f} ms, slot write {write_ms:.1f} ms (rank {args.rank})")


if __name__ == "__main__":
    main()
