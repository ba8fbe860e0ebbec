"""Offline throughput: ``LLM.generate`` over a whole workload, timed end to end.

Token counts come from the outputs (prompt tokens as the engine saw them, generated tokens as
returned). KV waste is sampled after every engine step (see ``kv_waste``); prefix-cache hits,
preemptions and steps are the engine counters' change over the run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from platform_core.bench.hooks import observe_calls
from platform_core.bench.kv_waste import KVWasteTracker
from platform_core.bench.workloads import BenchRequest, LengthRange, TokenSpace, random_requests
from platform_core.sampling_params import SamplingParams


@dataclass(slots=True)
class ThroughputResult:
    """One throughput run."""

    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    num_preemptions: int
    prefix_cache_hit_rate: float | None
    kv_waste_mean: float | None
    kv_waste_max: float | None
    kv_waste_samples: int
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (``None`` without speculation)."""
        if not self.spec_proposed_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_proposed_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens produced per verification step: accepted drafts plus the target's own."""
        if not self.spec_verifications:
            return None
        return (self.spec_accepted_tokens + self.spec_verifications) / self.spec_verifications

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "spec_mean_accepted_length": self.spec_mean_accepted_length,
        }


def sampling_params_for(
    request: BenchRequest, temperature: float = 0.0, ignore_eos: bool = True
) -> SamplingParams:
    """The request's parameters: its ``max_tokens``, seeded when sampling."""
    return SamplingParams(
        temperature=temperature,
        max_tokens=request.max_tokens,
        ignore_eos=ignore_eos,
        seed=None if temperature == 0.0 else 0,
    )


def warm_up(llm: Any, tokens: TokenSpace, num_requests: int = 2) -> None:
    """Run a few short requests so one-time costs stay out of the measurement."""
    if num_requests < 1:
        return
    requests = random_requests(num_requests, LengthRange(16, 16), LengthRange(4, 4), tokens, -1)
    llm.generate(
        [r.as_prompt() for r in requests],
        [sampling_params_for(r) for r in requests],
        use_tqdm=False,
    )


def run_throughput(
    llm: Any,
    requests: list[BenchRequest],
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> ThroughputResult:
    """Generate every request in one ``LLM.generate`` call and measure it."""
    prompts = [r.as_prompt() for r in requests]
    params = [sampling_params_for(r, temperature, ignore_eos) for r in requests]
    engine = llm.engine
    tracker = KVWasteTracker()
    before = llm.stats()
    with observe_calls(engine, "step", lambda _s, _r: tracker.record(engine.scheduler)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    after = llm.stats()

    def delta(key: str) -> int:
        return after[key] - before[key]

    queried = delta("prefix_cache_queried_tokens")
    return ThroughputResult(
        num_requests=len(outputs),
        elapsed_s=elapsed,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        num_steps=delta("num_steps"),
        num_preemptions=delta("num_preemptions"),
        prefix_cache_hit_rate=delta("prefix_cache_hit_tokens") / queried if queried else None,
        **tracker.summary(),
        spec_proposed_tokens=delta("spec_proposed_tokens"),
        spec_accepted_tokens=delta("spec_accepted_tokens"),
        spec_verifications=delta("spec_verifications"),
    )
