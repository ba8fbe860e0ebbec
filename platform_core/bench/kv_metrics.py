"""KV-transfer metrics of running servers, scraped from ``/metrics`` before and after a run.

A server with a KV connector exports ``platform_core_kv_transfer_*`` (METRICS.md): counters
(``*_total``), whose differences over a run are what the run moved, and gauges, of which the
load-latency percentiles are reported as they stand at the end. A server without a connector
(or without a readable ``/metrics``) exports none, and nothing is reported for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_PREFIX = "platform_core_kv_transfer_"
LATENCY_GAUGES = ("latency_p50_s", "latency_p99_s")


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """One scrape of one server: KV-transfer counters and gauges, names without the prefix
    (and counters without ``_total``)."""

    counters: dict[str, float]
    gauges: dict[str, float]


def parse_kv_metrics(text: str) -> KVSnapshot:
    """The KV-transfer samples of a Prometheus text exposition (labelled counters summed)."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    # By sample name, not family: the text parser files ``X_total`` under a family of its own
    # when the TYPE line names the counter ``X``.
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(KV_PREFIX):
                continue
            name = sample.name[len(KV_PREFIX) :]
            if name.endswith("_total"):
                key = name.removesuffix("_total")
                counters[key] = counters.get(key, 0.0) + sample.value
            elif not name.endswith("_created"):
                gauges[name] = sample.value
    return KVSnapshot(counters, gauges)


def scrape_kv_metrics(
    url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0
) -> KVSnapshot | None:
    """The KV-transfer metrics at ``url``/metrics; ``None`` when that cannot be read."""
    try:
        response = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return parse_kv_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def _number(value: float) -> int | float:
    return int(value) if value.is_integer() else value


def _label(name: str) -> str:
    text = name.replace("_", " ").capitalize()
    return text.removesuffix(" s") + " (s)" if name.endswith("_s") else text


@dataclass(frozen=True, slots=True)
class KVTransferDelta:
    """What one server's KV connector did over a run: counter differences, and the latency
    gauges at its end when it loaded KV meanwhile."""

    counters: dict[str, int | float]
    latency: dict[str, float]

    def rows(self) -> list[tuple[str, Any]]:
        """``(label, value)`` rows for ``report.print_rows``."""
        return [(_label(k), v) for k, v in (self.counters | self.latency).items()]

    def to_dict(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "latency": dict(self.latency)}


def kv_delta(before: KVSnapshot | None, after: KVSnapshot | None) -> KVTransferDelta | None:
    """The difference ``after - before`` (a counter missing before counts from 0) and the
    latency gauges if loads happened; ``None`` when ``after`` has no KV-transfer counters."""
    if after is None or not after.counters:
        return None
    start = before.counters if before else {}
    counters = {k: _number(v - start.get(k, 0.0)) for k, v in after.counters.items()}
    # The gauges describe the latest loads: this run's only if it loaded anything.
    loaded = counters.get("loads", 0) > 0
    latency = {k: after.gauges[k] for k in LATENCY_GAUGES if loaded and k in after.gauges}
    return KVTransferDelta(counters, latency)


class KVTransferWatch:
    """Scrapes servers' KV-transfer metrics when made; :meth:`deltas` scrapes them again."""

    def __init__(self, urls: Sequence[str], headers: Mapping[str, str] | None = None) -> None:
        self.headers = dict(headers or {})
        self.before = {url: scrape_kv_metrics(url, self.headers) for url in urls}

    def deltas(self) -> dict[str, KVTransferDelta | None]:
        """Each URL's :class:`KVTransferDelta` since construction (``None``: none exported)."""
        return {
            url: kv_delta(before, scrape_kv_metrics(url, self.headers))
            for url, before in self.before.items()
        }
