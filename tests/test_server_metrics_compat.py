"""``/metrics`` serves vLLM's metric names (``vllm:*``) beside ours, from the same samples, so a
Grafana dashboard built for vLLM shows data for platform-core."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL_NAME, engine_idle, wait_for

from platform_core.entrypoints.openai.vllm_metrics import VLLM_NAMES

# Every series the PromQL queries of vLLM's Grafana dashboard read, with its family's type:
# examples/observability/prometheus_grafana/grafana.json in vllm-project/vllm (the dashboard
# its Prometheus/Grafana example imports; earlier under examples/online_serving/), read at
# commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9. Each query filters on ``model_name``.
DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket": "histogram",
    "vllm:e2e_request_latency_seconds_sum": "histogram",
    "vllm:e2e_request_latency_seconds_count": "histogram",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:inter_token_latency_seconds_bucket": "histogram",
    "vllm:inter_token_latency_seconds_sum": "histogram",
    "vllm:inter_token_latency_seconds_count": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:time_to_first_token_seconds_bucket": "histogram",
    "vllm:time_to_first_token_seconds_sum": "histogram",
    "vllm:time_to_first_token_seconds_count": "histogram",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_prompt_tokens_bucket": "histogram",
    "vllm:request_generation_tokens_bucket": "histogram",
    "vllm:request_success_total": "counter",
    "vllm:request_queue_time_seconds_sum": "histogram",
    "vllm:request_prefill_time_seconds_sum": "histogram",
    "vllm:request_decode_time_seconds_sum": "histogram",
    "vllm:request_max_num_generation_tokens_sum": "histogram",
}
# Named by the issue, not read by that dashboard.
ALSO_EXPECTED = {"vllm:iteration_tokens_total_count": "histogram"}
# Prompts of at least one full 16-token block, so a repeat finds its prefix cached.
LONG_PROMPT = " ".join(["one two three four five six seven eight nine ten"] * 4)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _scrape(base_url: str) -> list:
    return list(text_string_to_metric_families(httpx.get(base_url + "/metrics").text))


def _values(families: list) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, over every sample."""
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def _total(families: list, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for f in families
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def _traffic(client, engine) -> dict[str, int]:
    """A mix of requests (plain, n=2, streamed chat, a repeated long prompt); what they used."""
    used = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0, "choices": 0}

    def add(usage, requests: int, choices: int) -> None:
        used["prompt_tokens"] += usage.prompt_tokens
        used["completion_tokens"] += usage.completion_tokens
        used["requests"] += requests
        used["choices"] += choices

    common = {"model": MODEL_NAME, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(prompt="The capital of France is", max_tokens=5, **common)
    add(r.usage, 1, 1)
    r = client.completions.create(prompt="A quick brown fox", max_tokens=4, n=2, **common)
    add(r.usage, 1, 2)
    for _ in range(2):
        r = client.completions.create(prompt=LONG_PROMPT, max_tokens=3, **common)
        add(r.usage, 1, 1)
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **common,
    )
    usage = [c.usage for c in stream if c.usage is not None]
    add(usage[-1], 1, 1)
    wait_for(lambda: engine_idle(engine), 10, "the engine did not go idle")
    return used


def test_dashboard_series_have_data_with_vllm_labels(client, base_url, engine):
    _traffic(client, engine)
    families = _scrape(base_url)
    for series, kind in {**DASHBOARD_SERIES, **ALSO_EXPECTED}.items():
        samples = [(f.type, s) for f in families for s in f.samples if s.name == series]
        assert samples, f"{series} is not served"
        for family_type, sample in samples:
            assert family_type == kind, series
            assert sample.labels["model_name"] == MODEL_NAME, series
            assert sample.labels["engine"] == "0", series
        if kind != "gauge":
            assert sum(s.value for _, s in samples) > 0, f"{series} has no data after traffic"
    reasons = {
        s.labels["finished_reason"]
        for f in families
        for s in f.samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"length"}  # every request above ran to max_tokens


def test_vllm_series_agree_with_ours_and_with_the_traffic(client, base_url, engine):
    before = _scrape(base_url)
    used = _traffic(client, engine)
    after = _scrape(base_url)
    vllm = {"model_name": MODEL_NAME, "engine": "0"}

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert grew("vllm:prompt_tokens_total", **vllm) == used["prompt_tokens"]
    assert grew("vllm:generation_tokens_total", **vllm) == used["completion_tokens"]
    assert grew("vllm:request_prompt_tokens_sum", **vllm) == used["prompt_tokens"]
    assert grew("vllm:request_generation_tokens_sum", **vllm) == used["completion_tokens"]
    assert grew("vllm:request_success_total", finished_reason="length") == used["choices"]
    assert grew("vllm:request_params_n_sum", **vllm) == used["choices"]
    for name in (
        "vllm:time_to_first_token_seconds_count",  # every request produced a token
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",  # each made 2+ tokens
        "vllm:request_num_preemptions_count",
    ):
        assert grew(name, **vllm) == used["requests"], name
    # The phases of a request add up to its end-to-end latency.
    phases = sum(grew(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert math.isclose(phases, grew("vllm:e2e_request_latency_seconds_sum"), rel_tol=1e-6)
    inference = grew("vllm:request_inference_time_seconds_sum")
    assert math.isclose(
        inference, phases - grew("vllm:request_queue_time_seconds_sum"), rel_tol=1e-6
    )
    assert grew("vllm:prefix_cache_hits_total") >= 16  # the repeated prompt's first block

    stats = engine.stats()
    assert _total(after, "vllm:iteration_tokens_total_count") == stats["num_steps"]
    assert _total(after, "vllm:iteration_tokens_total_sum") == stats["num_scheduled_tokens"]
    assert _total(after, "vllm:num_preemptions_total") == stats["num_preemptions"]
    assert _total(after, "vllm:num_requests_running") == 0


def test_every_vllm_series_is_a_copy_of_ours(client, base_url, engine):
    _traffic(client, engine)
    values = _values(_scrape(base_url))
    ours = {k: v for k, v in values.items() if k[0].startswith("platform_core_")}
    copies = 0
    for (name, labels), value in ours.items():
        family = next((n for n in VLLM_NAMES if name.startswith("platform_core_" + n)), None)
        if family is None or name.endswith("_created"):
            continue
        suffix = name.removeprefix("platform_core_" + family)
        vllm_labels = labels | {("model_name", MODEL_NAME), ("engine", "0")}
        assert values[(VLLM_NAMES[family] + suffix, vllm_labels)] == value, name
        copies += 1
    assert copies > 100  # buckets included: the loop really compared the series


def test_iteration_histogram_is_cumulative(client, base_url, engine):
    _traffic(client, engine)
    family = next(f for f in _scrape(base_url) if f.name == "vllm:iteration_tokens_total")
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[0] > 0  # decode steps of one token
    assert buckets[-1][0] == "+Inf"
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    assert buckets[-1][1] == count
