"""Side-by-side runs of one workload on several engines, and their markdown table.

Every engine gets the same token-id requests and reports the same counts: prompt tokens and the
output tokens each request asked for (``max_tokens``; EOS is ignored everywhere, so every engine
produces exactly those). Ratios are output tokens/s relative to platform-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from platform_core.bench.workloads import BenchRequest

BASELINE = "platform-core"


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One engine's timed run, or why it did not run (``skipped`` non-empty)."""

    engine: str
    num_requests: int = 0
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    skipped: str = ""
    note: str = ""

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": self.engine,
            "skipped": self.skipped,
            "note": self.note,
        }
        if not self.skipped:
            data.update(
                num_requests=self.num_requests,
                elapsed_s=self.elapsed_s,
                prompt_tokens=self.prompt_tokens,
                output_tokens=self.output_tokens,
                requests_per_s=self.requests_per_s,
                output_tokens_per_s=self.output_tokens_per_s,
                total_tokens_per_s=self.total_tokens_per_s,
            )
        return data


def timed_run(
    engine: str, requests: list[BenchRequest], elapsed_s: float, note: str = ""
) -> EngineRun:
    """An ``EngineRun`` for ``requests`` completed in ``elapsed_s`` seconds."""
    return EngineRun(
        engine=engine,
        num_requests=len(requests),
        elapsed_s=elapsed_s,
        prompt_tokens=sum(r.prompt_len or 0 for r in requests),
        output_tokens=sum(r.max_tokens for r in requests),
        note=note,
    )


def markdown_table(runs: list[EngineRun]) -> str:
    """``| engine | requests/s | output tok/s | total tok/s | ratio | note |`` rows."""
    baseline = next((r for r in runs if r.engine == BASELINE and not r.skipped), None)
    lines = [
        "| engine | requests/s | output tok/s | total tok/s | ratio to platform-core | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        if run.skipped:
            lines.append(f"| {run.engine} | - | - | - | - | not run: {run.skipped} |")
            continue
        ratio = f"{run.output_tokens_per_s / baseline.output_tokens_per_s:.2f}" if baseline else "-"
        lines.append(
            f"| {run.engine} | {run.requests_per_s:.2f} | {run.output_tokens_per_s:.1f} "
            f"| {run.total_tokens_per_s:.1f} | {ratio} | {run.note} |"
        )
    return "\n".join(lines)
