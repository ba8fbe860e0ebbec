"""Benchmark instruments: metrics math, KV waste, call observation and the offline commands end to
end (workloads: ``test_bench_workloads.py``; ``bench serve``: ``test_bench_serve.py``)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from bench_cli import run_cli
from scheduler_sim import make_request, make_scheduler, run_step

from platform_core.bench.hooks import observe_calls
from platform_core.bench.kv_waste import KVSample, KVWasteTracker, sample_kv
from platform_core.bench.metrics import (
    GoodputError,
    RequestRecord,
    meets_slo,
    parse_goodput,
    percentile,
    serve_metrics,
    summarize,
)
from platform_core.bench.serve import arrival_offsets
from platform_core.bench.workloads import (
    LengthRange,
    TokenSpace,
    random_requests,
)


# ---------------------------------------------------------------------------- metrics
def test_percentiles_interpolate_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    stats = summarize(values, (10, 90))
    assert stats == {"mean": 2.5, "median": 2.5, "p10": pytest.approx(1.3), "p90": 3.7}
    assert summarize([], (99,)) == {"mean": None, "median": None, "p99": None}


def test_tpot_excludes_the_first_token():
    record = RequestRecord(True, output_len=11, ttft=0.5, latency=1.5)
    assert record.tpot == pytest.approx(0.1)  # 1.0 s after the first token, 10 more tokens
    assert RequestRecord(True, output_len=1, ttft=0.5, latency=0.5).tpot is None
    assert RequestRecord(False, output_len=5, ttft=0.1, latency=1.0).tpot is None


def test_goodput_counts_requests_within_every_slo():
    slo = parse_goodput(["ttft:200", "tpot:50"])
    assert slo == {"ttft": 200.0, "tpot": 50.0}
    records = [
        RequestRecord(True, 10, 5, ttft=0.1, latency=0.3),  # tpot 50 ms: good (inclusive)
        RequestRecord(True, 10, 5, ttft=0.3, latency=0.4),  # ttft too slow
        RequestRecord(True, 10, 5, ttft=0.1, latency=0.6),  # tpot 125 ms: too slow
        RequestRecord(True, 10, 1, ttft=0.15, latency=0.15),  # one token: no tpot to miss
        RequestRecord(False, error="boom"),
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    metrics = serve_metrics(records, duration=2.0, percentiles=(50,), slo=slo)
    assert metrics["good_requests"] == 2
    assert metrics["goodput"] == 1.0
    assert (metrics["completed"], metrics["failed"]) == (4, 1)
    assert metrics["total_output_tokens"] == 16
    assert metrics["output_throughput"] == 8.0
    assert metrics["total_token_throughput"] == 28.0
    assert metrics["request_throughput"] == 2.0
    assert metrics["ttft_ms"]["median"] == pytest.approx(125.0)
    assert metrics["tpot_ms"]["mean"] == pytest.approx((50 + 25 + 125) / 3)
    assert metrics["errors"] == ["boom"]


@pytest.mark.parametrize("bad", ["ttft", "speed:10", "ttft:abc", "tpot:0"])
def test_goodput_rejects_bad_targets(bad):
    with pytest.raises(GoodputError):
        parse_goodput([bad])


def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    offsets = arrival_offsets(4000, 20.0, seed=3)
    assert offsets == arrival_offsets(4000, 20.0, seed=3)
    assert all(b > a for a, b in itertools.pairwise(offsets))
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20.0, rel=0.05)


# ---------------------------------------------------------------------------- KV waste, hooks
def test_kv_waste_counts_shared_blocks_once():
    scheduler = make_scheduler(block_size=4, prefix_caching=True)
    prompt = list(range(10, 20))
    scheduler.add_request(make_request("a", prompt, max_tokens=8))
    run_step(scheduler)  # a: 10 computed tokens in 3 blocks
    assert sample_kv(scheduler) == KVSample(allocated_slots=12, live_tokens=10)
    scheduler.add_request(make_request("b", prompt[:8] + [90, 91], max_tokens=8))
    run_step(scheduler)  # a: 11 computed; b: reuses a's two full blocks, computes 2 more
    sample = sample_kv(scheduler)
    assert scheduler.kv_stats().num_used_blocks == 4
    assert (sample.allocated_slots, sample.live_tokens) == (16, 4 + 4 + 3 + 2)
    assert sample.waste == pytest.approx(3 / 16)
    tracker = KVWasteTracker()
    tracker.record(scheduler)
    tracker.record(make_scheduler())  # nothing allocated: not a sample
    assert tracker.summary() == {
        "kv_waste_mean": pytest.approx(3 / 16),
        "kv_waste_max": pytest.approx(3 / 16),
        "kv_waste_samples": 1,
    }


def test_observe_calls_reports_and_restores():
    class Box:
        def double(self, x):
            return 2 * x

    box = Box()
    seen = []
    with observe_calls(box, "double", lambda seconds, result: seen.append((seconds, result))):
        assert box.double(4) == 8
    assert "double" not in vars(box)
    assert box.double(1) == 2
    assert len(seen) == 1 and seen[0][1] == 8 and seen[0][0] >= 0


# ---------------------------------------------------------------------------- offline commands
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(4 << 20), "--block-size", "8")


def test_bench_throughput_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["--model", str(tiny_model_dir("llama")), *ENGINE_FLAGS]
    argv += ["--num-prompts", "6", "--input-len", "4:20", "--output-len", "2:6"]
    assert (
        run_cli("throughput", *argv, "--num-warmup-requests", "1", "--save-result", str(out)) == 0
    )
    printed = capsys.readouterr().out
    assert "Output tokens/s" in printed and "KV waste mean" in printed
    saved = json.loads(out.read_text())
    expected = random_requests(6, LengthRange(4, 20), LengthRange(2, 6), TokenSpace(0, 256), 0)
    result = saved["result"]
    assert saved["benchmark"] == "throughput" and saved["settings"]["num_prompts"] == 6
    assert saved["machine"]["cpu_count"] >= 1
    assert result["num_requests"] == 6
    assert result["prompt_tokens"] == sum(r.prompt_len for r in expected)
    assert result["output_tokens"] == sum(r.max_tokens for r in expected)  # EOS ignored
    assert result["requests_per_s"] == pytest.approx(6 / result["elapsed_s"])
    total = result["prompt_tokens"] + result["output_tokens"]
    assert result["total_tokens_per_s"] == pytest.approx(total / result["elapsed_s"])
    assert 0.0 <= result["kv_waste_mean"] <= result["kv_waste_max"] < 1.0
    assert result["kv_waste_samples"] >= max(r.max_tokens for r in expected) - 1


def test_bench_throughput_shared_prefix_hits_the_cache(tiny_model_dir, tmp_path):
    out = tmp_path / "sp.json"
    argv = ["--model", str(tiny_model_dir("llama")), *ENGINE_FLAGS, "--workload", "shared-prefix"]
    argv += ["--num-prompts", "4", "--prefix-len", "32", "--suffix-len", "3", "--output-len", "2"]
    argv += ["--max-num-batched-tokens", "40", "--no-enable-chunked-prefill"]
    assert run_cli("throughput", *argv, "--save-result", str(out)) == 0
    result = json.loads(out.read_text())["result"]
    # The first request computes the prefix alone (no room for a second whole prompt in the
    # 40-token budget); the other three then reuse its 4 full blocks: 32 of their 35 tokens.
    assert result["prefix_cache_hit_rate"] == pytest.approx(3 * 32 / (4 * 35))


def test_bench_latency_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    argv = ["--model", str(tiny_model_dir("llama")), *ENGINE_FLAGS, "--batch-size", "2"]
    argv += ["--input-len", "5", "--output-len", "3", "--num-iters-warmup", "1", "--num-iters", "4"]
    assert run_cli("latency", *argv, "--save-result", str(out)) == 0
    assert "P99 latency (s)" in capsys.readouterr().out
    result = json.loads(out.read_text())["result"]
    latencies = result["latencies_s"]
    assert len(latencies) == 4
    assert min(latencies) <= result["p10_s"] <= result["p50_s"] <= result["p99_s"]
    assert result["p99_s"] <= max(latencies)
    assert result["mean_s"] == pytest.approx(sum(latencies) / 4)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_null_model_overhead(tiny_model_dir, prefix_caching):
    from platform_core.bench.overhead import PHASES, NullModel, build_null_llm, measure_overhead
    from platform_core.sampling_params import SamplingParams

    llm = build_null_llm(
        str(tiny_model_dir("llama")), 4, max_len=64, block_size=8, prefix_caching=prefix_caching
    )
    assert llm.engine.scheduler.kv.enable_prefix_caching is prefix_caching
    model = llm.engine.runner.model
    assert isinstance(model, NullModel)
    favourite = model.favourite
    assert (model.logits.argmax(dim=-1) == favourite).all()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [favourite] * 3
    result = measure_overhead(llm, num_running=4, num_steps=3, prompt_len=8)
    assert result["num_running"] == 4 and result["num_steps"] == 3
    assert result["step_ms"]["mean"] > 0
    assert all(result[f"{p}_ms_mean"] >= 0 for p in PHASES)
    assert result["other_ms_mean"] > -1e-6
    assert llm.stats()["num_running"] == 0  # measured requests were aborted


def test_null_model_logits_come_in_the_models_dtype():
    from platform_core.bench.overhead import build_null_llm
    from platform_core.sampling_params import SamplingParams

    llm = build_null_llm(None, 2, max_len=32, block_size=8, dtype="bfloat16")
    model = llm.engine.runner.model
    assert str(model.logits.dtype) == "torch.bfloat16"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [model.favourite] * 2
