"""Latency statistics and serving metrics: percentiles, TTFT/TPOT/ITL/E2E, goodput.

Definitions (per successful request, times in seconds, reported in milliseconds):

- TTFT: from sending the request to receiving the first streamed token.
- TPOT: ``(latency - ttft) / (output_len - 1)``, the mean time per token after the first (the
  first token is excluded, it is prefill); undefined for one-token outputs.
- ITL: every gap between consecutive streamed chunks, pooled over all requests.
- E2E latency: from sending the request to the end of the stream.
- Goodput: requests per second that meet every given SLO (``ttft``, ``tpot``, ``e2el``, in ms).
  A one-token request has no TPOT and so cannot miss a TPOT target.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from platform_core.errors import PlatformCoreError

SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolating linearly between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    """``{"mean", "median", "p<q>"...}`` of ``values``; every entry ``None`` when empty."""
    keys = ["mean", "median"] + [f"p{q:g}" for q in percentiles]
    if not values:
        return dict.fromkeys(keys)
    stats: dict[str, float | None] = {
        "mean": float(np.mean(values)),
        "median": percentile(values, 50),
    }
    for q in percentiles:
        stats[f"p{q:g}"] = percentile(values, q)
    return stats


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times are seconds from sending it."""

    success: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; ``None`` below two tokens or on failure."""
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


class GoodputError(PlatformCoreError, ValueError):
    """A malformed ``--goodput`` target."""


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise GoodputError(
                f"bad goodput target {item!r}: expected KEY:MS with KEY in {SLO_KEYS}"
            )
        try:
            ms = float(value)
        except ValueError as exc:
            raise GoodputError(f"bad goodput target {item!r}: {value!r} is not a number") from exc
        if ms <= 0:
            raise GoodputError(f"bad goodput target {item!r}: the limit must be > 0 ms")
        slo[key] = ms
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """True when the request succeeded and is within every target of ``slo`` (ms)."""
    if not record.success:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all(
        observed[key] is None or observed[key] * 1000.0 <= limit for key, limit in slo.items()
    )


def serve_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Iterable[float] = (99,),
    slo: dict[str, float] | None = None,
) -> dict[str, object]:
    """Aggregate one serving run: counts, throughputs, latency statistics (ms), goodput."""
    percentiles = list(percentiles)
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)

    def ms(values: Iterable[float | None]) -> list[float]:
        return [v * 1000.0 for v in values if v is not None]

    result: dict[str, object] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0
        else 0.0,
        "ttft_ms": summarize(ms(r.ttft for r in ok), percentiles),
        "tpot_ms": summarize(ms(r.tpot for r in ok), percentiles),
        "itl_ms": summarize(ms(gap for r in ok for gap in r.itl), percentiles),
        "e2el_ms": summarize(ms(r.latency for r in ok), percentiles),
        "errors": sorted({r.error for r in records if not r.success})[:10],
    }
    if slo:
        good = sum(1 for r in records if meets_slo(r, slo))
        result["goodput_slo_ms"] = dict(slo)
        result["goodput"] = good / duration if duration > 0 else 0.0
        result["good_requests"] = good
    return result
