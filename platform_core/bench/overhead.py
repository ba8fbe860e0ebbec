"""Engine overhead per step, with the model replaced by one that costs nothing.

``NullModel`` has the attributes the runner reads and answers instantly: zero hidden states and
logits rows it made once in the model's dtype (distinct memory per row, so the sampler scans as
many bytes as it would behind a real head; every row's maximum is the same token). What remains
of a step is the engine's own work, timed by phase: ``schedule`` (``Scheduler.schedule``),
``plan`` (host-side input building, ``ModelRunner.plan``), ``forward`` (moving inputs to the
device and the null forward, ``ModelRunner.forward``), ``sample``
(``ModelRunner.step_sampler``), ``update`` (``Scheduler.update``) and ``other``: the rest of
``LLMEngine.step`` (deadline checks, building outputs, detokenizing when the model has a
tokenizer). Steps are timed once all ``N`` requests are running and decoding, so each step is
exactly ``N`` decode tokens. ``--final-outputs-only`` adds the requests as ``LLM.generate`` does
(no per-step outputs).

Run: ``python -m platform_core.bench.overhead [--model DIR] [--batch-sizes 32,128,256]``.
Without ``--model`` a one-layer float32 random Llama with a 32000-token vocabulary is built (the
vocabulary size and the logits' dtype set the sampler's cost; the layers do not matter).
``--dtype`` is the engine's (``auto``: what the backend runs a float32 checkpoint in, bf16 on CPUs
with native bf16), so the dtype of the logits the sampler reads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from contextlib import ExitStack
from typing import Any

import torch

from platform_core.bench.hooks import observe_calls
from platform_core.bench.metrics import summarize
from platform_core.bench.report import machine_info
from platform_core.bench.workloads import LengthRange, TokenSpace, random_requests
from platform_core.sampling_params import SamplingParams

PHASES = ("schedule", "plan", "forward", "sample", "update")


class NullModel(torch.nn.Module):
    """A stand-in for a ``CausalLM``: same shape attributes, no compute, logits made once.

    Writing the logits is the model's cost, not the engine's, so ``compute_logits`` returns rows
    of a buffer filled at start (the sampler never writes into its input). ``favourite`` is the
    greedy token of every row.
    """

    def __init__(self, like: Any, max_rows: int = 256, seed: int = 0) -> None:
        super().__init__()
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_size", "vocab_size"):
            setattr(self, name, getattr(like, name))
        self.dtype = next(like.parameters()).dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.favourite = int(torch.randint(self.vocab_size, (), generator=self.generator))
        self.logits = self._make_rows(max_rows)

    def _make_rows(self, rows: int) -> torch.Tensor:
        logits = torch.randn(rows, self.vocab_size, generator=self.generator)
        logits[:, self.favourite] = logits.max() + 1.0  # still the largest after rounding
        return logits.to(self.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, metadata: Any
    ) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self.logits.shape[0]:
            self.logits = self._make_rows(rows)
        return self.logits[:rows]


def measure_overhead(
    llm: Any,
    num_running: int,
    num_steps: int = 50,
    prompt_len: int = 32,
    seed: int = 0,
    stream: bool = True,
) -> dict[str, Any]:
    """Per-step times (ms) at ``num_running`` decoding requests (the engine holds a NullModel).

    ``stream`` as in ``LLMEngine.add_request``: True builds every request's output each step
    (a streaming server), False only final ones (``LLM.generate``).
    """
    engine = llm.engine
    tokens = TokenSpace.from_tokenizer(engine.tokenizer, engine.vocab_size)
    requests = random_requests(
        num_running, LengthRange(prompt_len, prompt_len), LengthRange(1, 1), tokens, seed
    )
    # Early admits decode while later ones still prefill: leave room for those tokens too.
    max_tokens = num_steps + 2 * num_running
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for request in requests:
        ids.append(engine.new_request_id())
        engine.add_request(
            ids[-1], None, params, prompt_token_ids=request.prompt_token_ids, stream=stream
        )
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running
    ):
        engine.step()
    if len(scheduler.running) != num_running:
        raise RuntimeError(f"only {len(scheduler.running)} of {num_running} requests could run")

    spans: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    observed = {
        "schedule": (scheduler, "schedule"),
        "plan": (runner, "plan"),
        "forward": (runner, "forward"),
        "sample": (runner, "step_sampler"),
        "update": (scheduler, "update"),
        "step": (engine, "step"),
    }
    with ExitStack() as stack:
        for phase, (obj, name) in observed.items():
            sink = spans[phase]
            stack.enter_context(observe_calls(obj, name, lambda s, _r, sink=sink: sink.append(s)))
        for _ in range(num_steps):
            engine.step()
    still_running = len(scheduler.running)
    engine.abort_request(ids)
    if still_running != num_running:
        raise RuntimeError("requests finished while being timed; raise max_tokens")
    for phase in observed:
        if len(spans[phase]) != num_steps:
            raise RuntimeError(
                f"{phase} ran {len(spans[phase])} times in {num_steps} steps: the engine's step "
                "no longer has the structure this benchmark times"
            )

    ms = {phase: [1000.0 * s for s in values] for phase, values in spans.items()}
    ms["other"] = [step - sum(ms[p][i] for p in PHASES) for i, step in enumerate(ms["step"])]
    step_mean = sum(ms["step"]) / num_steps
    return {
        "num_running": num_running,
        "num_steps": num_steps,
        "step_ms": summarize(ms["step"], (99,)),
        "per_request_us": step_mean * 1000.0 / num_running,
        **{f"{p}_ms_mean": sum(ms[p]) / num_steps for p in (*PHASES, "other")},
    }


def build_null_llm(
    model: str | None,
    max_running: int,
    max_len: int,
    block_size: int,
    prefix_caching: bool = False,
    dtype: str = "auto",
) -> Any:
    """An ``LLM`` in ``dtype`` on ``model`` (default: a one-layer float32 random Llama) with a
    ``NullModel``."""
    from platform_core.bench.random_model import RandomLlamaSpec, build_random_llama
    from platform_core.entrypoints.llm import LLM

    if model is None:
        spec = RandomLlamaSpec(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=128,
            dtype="float32",
        )
        model = str(build_random_llama(tempfile.mkdtemp(prefix="null-llama-"), spec))
    blocks = max_running * -(-max_len // block_size) + 1
    llm = LLM(
        model,
        max_num_seqs=max_running,
        num_gpu_blocks_override=blocks,
        block_size=block_size,
        max_num_batched_tokens=max(2048, max_running),
        enable_prefix_caching=prefix_caching,
        dtype=dtype,
    )
    llm.engine.runner.model = NullModel(llm.engine.runner.model, max_running)
    llm.engine.runner.graph_runner = None  # a backend's graph runner replays the real model
    return llm


def main(argv: list[str] | None = None) -> int:
    """Print a markdown table of per-step overhead at each batch size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model dir (default: a one-layer random Llama)")
    parser.add_argument("--batch-sizes", default="32,128,256")
    parser.add_argument("--num-steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="off",
        help="publish completed blocks to the prefix cache as the engine's default does (the "
        "random prompts never hit it; 'on' adds the bookkeeping)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the engine's dtype, so the dtype of the logits the sampler reads (auto: the "
        "backend's choice for a float32 checkpoint)",
    )
    parser.add_argument(
        "--final-outputs-only",
        action="store_true",
        help="requests report only when finished (as LLM.generate) instead of every step",
    )
    parser.add_argument("--save-result", metavar="FILE")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_len = args.prompt_len + args.num_steps + 2 * max(sizes) + 1
    llm = build_null_llm(
        args.model, max(sizes), max_len, args.block_size, args.prefix_caching == "on", args.dtype
    )
    stream = not args.final_outputs_only
    rows = [measure_overhead(llm, n, args.num_steps, args.prompt_len, 0, stream) for n in sizes]
    print(
        "| running | step ms mean | step ms p99 | us/request | schedule | plan "
        "| forward (null) | sample | update | other |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['num_running']} | {r['step_ms']['mean']:.2f} | {r['step_ms']['p99']:.2f} "
            f"| {r['per_request_us']:.1f} | "
            + " | ".join(f"{r[f'{p}_ms_mean']:.2f}" for p in (*PHASES, "other"))
            + " |"
        )
    load = machine_info()["load_average_1_5_15"]
    print(f"(per-phase columns: mean ms per step; load average {load})")
    if args.save_result:
        payload = {
            "benchmark": "overhead",
            "settings": vars(args),
            "machine": machine_info(),
            "result": rows,
        }
        with open(args.save_result, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
