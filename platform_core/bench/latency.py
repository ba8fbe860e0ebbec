"""Latency of one fixed batch: warm-up iterations, then measured ones, each a full generate.

Every iteration draws fresh random prompts (seed + iteration), so with prefix caching on a later
iteration cannot reuse an earlier one's KV blocks and look faster than a cold batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from platform_core.bench.metrics import summarize
from platform_core.bench.throughput import sampling_params_for
from platform_core.bench.workloads import LengthRange, TokenSpace, random_requests

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclass(slots=True)
class LatencyResult:
    """Seconds per measured iteration of a ``batch_size`` x (input, output) batch."""

    batch_size: int
    input_len: int
    output_len: int
    latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        return summarize(self.latencies_s, LATENCY_PERCENTILES)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "latencies_s": self.latencies_s,
            **{f"{k}_s": v for k, v in self.summary().items()},
        }


def run_latency(
    llm: Any,
    batch_size: int,
    input_len: int,
    output_len: int,
    tokens: TokenSpace,
    num_warmup: int = 2,
    num_iters: int = 10,
    seed: int = 0,
) -> LatencyResult:
    """Time ``num_iters`` generates of one batch after ``num_warmup`` untimed ones."""
    result = LatencyResult(batch_size, input_len, output_len)
    for i in range(num_warmup + num_iters):
        batch = random_requests(
            batch_size,
            LengthRange(input_len, input_len),
            LengthRange(output_len, output_len),
            tokens,
            seed + i,
        )
        prompts = [r.as_prompt() for r in batch]
        params = [sampling_params_for(r) for r in batch]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if i >= num_warmup:
            result.latencies_s.append(time.perf_counter() - start)
    return result
