"""The proxy's Prometheus metrics, in its own ``CollectorRegistry`` (never the global one)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from platform_core.entrypoints.proxy.routing import UpstreamPool

PREFIX = "platform_core_proxy_"
# How a request ended: answered 2xx; refused (4xx, from an upstream or the proxy); failed at
# an upstream (502, or a stream cut); refused for want of a healthy instance of a side (503);
# the client left before the end.
Outcome = Literal["success", "client_error", "upstream_error", "unavailable", "disconnected"]
_LATENCY_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
)


def outcome_of(status: int) -> Outcome:
    """The outcome of a request answered with HTTP ``status`` in full."""
    if status >= 500:
        return "upstream_error"
    return "client_error" if status >= 400 else "success"


class _Upstreams(Collector):
    """Requests in flight and health per upstream, read from the pools at scrape time."""

    def __init__(self, pools: Sequence[UpstreamPool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            PREFIX + "upstream_in_flight",
            "Requests the proxy has in flight at each upstream instance.",
            labels=["side", "upstream"],
        )
        healthy = GaugeMetricFamily(
            PREFIX + "upstream_healthy",
            "Whether each upstream instance is in rotation (1) or out of it as unhealthy (0).",
            labels=["side", "upstream"],
        )
        for pool in self.pools:
            for upstream in pool.upstreams:
                in_flight.add_metric([pool.side, upstream.url], upstream.in_flight)
                healthy.add_metric([pool.side, upstream.url], int(upstream.healthy))
        yield in_flight
        yield healthy


class ProxyMetrics:
    """Requests by endpoint and outcome, upstream failures by side, in-flight requests and
    health per upstream, prefill latency (to the prefill instance's whole answer) and the time
    to the first byte of the decode instance's answer."""

    def __init__(self, pools: Sequence[UpstreamPool]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Requests answered, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors",
            "Upstream instances unreachable, failing (5xx) or cutting a stream.",
            ["side", "upstream"],
            registry=self.registry,
        )
        self.prefill_latency = Histogram(
            PREFIX + "prefill_latency_seconds",
            "From sending a request to a prefill instance to its whole answer.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode_first_byte = Histogram(
            PREFIX + "decode_time_to_first_byte_seconds",
            "From sending a request to a decode instance to the first byte of its answer.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Upstreams(pools))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
