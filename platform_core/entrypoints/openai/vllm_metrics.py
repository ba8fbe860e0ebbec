"""vLLM's names for our metrics, so dashboards built for vLLM (``vllm:*`` queries) show data.

Nothing is counted twice: ``VllmAliases`` collects our families once per scrape and yields
each of them as is and, when vLLM has the same series, again under vLLM's name with vLLM's
``model_name`` and ``engine`` labels. Both names therefore always report the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

# Our name (without the ``platform_core_`` prefix) -> vLLM's family name, for every series
# vLLM serves with the same meaning (vLLM names its step-size histogram with a ``_total``).
VLLM_NAMES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "num_preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "iteration_tokens": "vllm:iteration_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "request_success": "vllm:request_success",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "request_inference_time_seconds": "vllm:request_inference_time_seconds",
    "request_prompt_tokens": "vllm:request_prompt_tokens",
    "request_generation_tokens": "vllm:request_generation_tokens",
    "request_max_num_generation_tokens": "vllm:request_max_num_generation_tokens",
    "request_params_n": "vllm:request_params_n",
    "request_num_preemptions": "vllm:request_num_preemptions",
}
# One engine per server process as vLLM labels it; data-parallel replicas are reported summed.
ENGINE_LABEL = "0"


class VllmAliases(Collector):
    """Every family of ``source``, followed by its vLLM-named copy where vLLM has one."""

    def __init__(self, source: CollectorRegistry, prefix: str, model_name: str) -> None:
        self.source = source
        self.prefix = prefix
        self.labels = {"model_name": model_name, "engine": ENGINE_LABEL}

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield family
            alias = VLLM_NAMES.get(family.name.removeprefix(self.prefix))
            if alias is not None:
                yield _renamed(family, alias, self.labels)


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """``family`` under ``name``, each sample carrying ``labels`` besides its own."""
    copy = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        suffix = sample.name.removeprefix(family.name)  # "_total", "_bucket", "_sum", ...
        copy.add_sample(name + suffix, {**labels, **sample.labels}, sample.value, sample.timestamp)
    return copy
