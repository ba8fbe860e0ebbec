"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (never the global one).

Engine state (running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions) is
read from ``AsyncEngine.stats()`` at scrape time. Per-request numbers (token counters and the
latency histograms) are recorded as outputs reach the HTTP side, through ``RequestTracker``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.outputs import RequestOutput

PREFIX = "platform_core_"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the engine's latest stats snapshot."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        queried = s["prefix_cache_queried_tokens"]
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", s["num_running"]),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s["num_waiting"]),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                s["kv_blocks_used"] / max(1, s["kv_blocks_total"]),
            ),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
                s["prefix_cache_hit_tokens"] / queried if queried else 0.0,
            ),
            (
                "spec_decode_acceptance_rate",
                "Accepted / proposed speculative draft tokens, since start.",
                s["spec_acceptance_rate"],
            ),
            (
                "spec_decode_mean_accepted_length",
                "Tokens produced per speculative verification step, since start.",
                s["spec_mean_accepted_length"],
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = (
            ("num_preemptions", "Preemptions since start.", s["num_preemptions"]),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s["prefix_cache_hit_tokens"],
            ),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed.", s["spec_proposed_tokens"]),
            (
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                s["spec_accepted_tokens"],
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """The metrics one server exports at ``/metrics``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive tokens of a sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)

    def track(self) -> RequestTracker:
        """A recorder for the outputs of one request."""
        return RequestTracker(self)


class RequestTracker:
    """Records one request's tokens and latencies from the outputs it yields, in order."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.num_tokens = 0  # over all samples
        self.steps = 0  # tokens of the longest sample
        self.last_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        """Take the request's newest (cumulative) output."""
        m = self.metrics
        now = time.monotonic()
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        new_tokens = num_tokens - self.num_tokens
        steps = max((len(o.token_ids) for o in output.outputs), default=0)
        if self.last_time is None:
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            timing = output.metrics
            if timing is not None and timing.first_token_time is not None:
                m.time_to_first_token.observe(timing.first_token_time - timing.arrival_time)
        elif new_tokens > 0:
            # Several steps may arrive at once; spread the gap over the tokens of one sequence.
            per_seq = max(1, steps - self.steps)
            for _ in range(per_seq):
                m.inter_token_latency.observe((now - self.last_time) / per_seq)
        m.generation_tokens.inc(max(0, new_tokens))
        self.num_tokens, self.steps, self.last_time = num_tokens, steps, now
        if output.finished and output.metrics is not None:
            timing = output.metrics
            end = timing.finished_time or time.time()
            m.e2e_latency.observe(end - timing.arrival_time)
