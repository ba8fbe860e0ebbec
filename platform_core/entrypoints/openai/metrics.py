"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (never the global one).

Engine state (running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions,
step sizes) is read from ``SubmitFront.stats()`` at scrape time. Per-request numbers (token
counters, finish reasons and the latency histograms) are recorded as outputs reach the HTTP side,
through ``RequestTracker``. Every series is also exported under vLLM's name (``vllm_metrics``);
docs/METRICS.md lists them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from platform_core.engine.outputs import RequestOutput
from platform_core.engine.request_stream import SubmitFront
from platform_core.engine.stats import STEP_BUCKET_KEYS
from platform_core.entrypoints.openai.vllm_metrics import VllmAliases
from platform_core.scheduler.stats import STEP_TOKEN_BUCKETS

PREFIX = "platform_core_"
# Histogram bounds: vLLM's defaults, so the ``vllm:*`` copies (``vllm_metrics``) are vLLM's too.
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_REQUEST_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0),
    *(30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len``: bounds for per-request token counts."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Engine gauges, counters and the step-size histogram, from one stats snapshot."""

    def __init__(self, engine: SubmitFront) -> None:
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
            (
                "spec_decode_num_drafts",
                "Speculative verification steps (one per request and step with drafts).",
                s["spec_verifications"],
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
        if "kv_transfer_loads" in s:  # a KV connector runs
            yield from _kv_transfer_metrics(s)
        cumulative = accumulate(s[key] for key in STEP_BUCKET_KEYS)
        steps = [(str(b), n) for b, n in zip(STEP_TOKEN_BUCKETS, cumulative, strict=True)]
        yield HistogramMetricFamily(
            PREFIX + "iteration_tokens",
            "Tokens scheduled per engine step (prompt chunks, decodes and drafts).",
            buckets=[*steps, ("+Inf", s["num_steps"])],
            sum_value=s["num_scheduled_tokens"],
        )


# KV-connector counters: metric name, stats key, help text.
_KV_TRANSFER_COUNTERS = (
    ("kv_transfer_bytes_received", "Bytes of KV blocks loaded from producers."),
    ("kv_transfer_bytes_sent", "Bytes of KV blocks served to consumers."),
    ("kv_transfer_blocks_received", "KV blocks loaded from producers."),
    ("kv_transfer_blocks_sent", "KV blocks served to consumers."),
    ("kv_transfer_failed_blocks", "KV blocks that failed to load (recomputed)."),
    ("kv_transfer_failed_transfers", "Loads with at least one failed block."),
    ("kv_transfer_loads", "Requests that loaded prompt KV from a producer."),
    ("kv_transfer_loaded_tokens", "Prompt tokens whose KV was loaded, not computed."),
    ("kv_transfer_recomputed_tokens", "Prompt tokens whose load failed and were recomputed."),
    ("kv_transfer_holds", "Finished prompts whose blocks were held for a consumer."),
    ("kv_transfer_hold_timeouts", "Held blocks freed because no consumer came in time."),
)
_KV_TRANSFER_GAUGES = (
    ("kv_transfer_loading", "Requests waiting for their prompt's KV blocks to load."),
    ("kv_transfer_held", "Finished prompts whose blocks are held for a consumer."),
    ("kv_transfer_latency_p50_s", "Median duration of the latest KV loads, in seconds."),
    ("kv_transfer_latency_p99_s", "99th percentile duration of the latest KV loads, seconds."),
)


def _kv_transfer_metrics(stats: dict) -> Iterator[Metric]:
    for key, doc in _KV_TRANSFER_COUNTERS:
        yield CounterMetricFamily(PREFIX + key, doc, value=stats[key])
    for key, doc in _KV_TRANSFER_GAUGES:
        yield GaugeMetricFamily(PREFIX + key, doc, value=stats[key])


class ServerMetrics:
    """The metrics one server exports at ``/metrics``: ours (``platform_core_*``) and,
    from the same samples, vLLM's names for them (``vllm:*``, see ``vllm_metrics``)."""

    def __init__(self, engine: SubmitFront, model_name: str) -> None:
        ours = CollectorRegistry()
        ours.register(_EngineCollector(engine))
        self.registry = CollectorRegistry()
        self.registry.register(VllmAliases(ours, PREFIX, model_name))
        # One of several API servers (``api_worker``): each records into files in this
        # directory and every scrape sums them all; the engine gauges come from the core.
        shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared_dir:
            MultiProcessCollector(ours, shared_dir)
        own = None if shared_dir else ours

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=own)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=own)

        tokens = token_buckets(engine.max_model_len)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter(
            "request_success",
            "Finished sequences (one per sample), by finish reason.",
            ("finished_reason",),
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between successive tokens of a sequence.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "First to last token over the tokens after the first (requests of 2+ tokens).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens per finished request (all samples).",
            tokens,
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of the longest sample, per finished request.",
            tokens,
        )
        self.request_n = histogram("request_params_n", "Samples (n) per request.", _N_BUCKETS)
        self.request_preemptions = histogram(
            "request_num_preemptions", "Preemptions per finished request.", _PREEMPTION_BUCKETS
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
        if output.finished:
            self._finish(output)

    def _finish(self, output: RequestOutput) -> None:
        m = self.metrics
        for completion in output.outputs:
            m.request_success.labels(completion.finish_reason).inc()
        m.request_prompt_tokens.observe(len(output.prompt_token_ids))
        m.request_generation_tokens.observe(self.num_tokens)
        m.request_max_generation_tokens.observe(self.steps)
        m.request_n.observe(len(output.outputs))
        timing = output.metrics
        if timing is None:
            return
        m.request_preemptions.observe(timing.num_preemptions)
        end = timing.finished_time or time.time()
        m.e2e_latency.observe(end - timing.arrival_time)
        scheduled, first = timing.scheduled_time, timing.first_token_time
        if scheduled is not None:
            m.queue_time.observe(scheduled - timing.arrival_time)
            m.inference_time.observe(end - scheduled)
            if first is not None:
                m.prefill_time.observe(first - scheduled)
        if first is not None:
            m.decode_time.observe(end - first)
            if self.steps > 1:
                m.time_per_output_token.observe((end - first) / (self.steps - 1))
