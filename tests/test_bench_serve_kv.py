"""``bench serve`` reports what the servers' KV connectors moved: the differences of the
``platform_core_kv_transfer_*`` counters between a scrape before and one after the run, and the
latency gauges at its end, from stub servers whose ``/metrics`` answers are scripted (written by
prometheus_client, as the real server's are). Without such metrics nothing is reported."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from bench_cli import run_cli
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from platform_core.bench.kv_metrics import KVSnapshot, parse_kv_metrics

PREFIX = "platform_core_kv_transfer_"
WORKLOAD = ("--token-id-range", "10:50", "--num-prompts", "2", "--output-len", "2")


def exposition(counters: dict[str, float], gauges: dict[str, float]) -> str:
    """Prometheus text with these counters and gauges, plus one metric of another family."""

    class Collector:
        def collect(self):
            yield CounterMetricFamily("platform_core_num_preemptions", "Other.", value=3)
            for name, value in counters.items():
                yield CounterMetricFamily(PREFIX + name, "A counter.", value=value)
            for name, value in gauges.items():
                yield GaugeMetricFamily(PREFIX + name, "A gauge.", value=value)

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


class StubServer(BaseHTTPRequestHandler):
    """``GET /metrics``: the next scripted text (the last one again once they run out; 404 when
    there are none); ``POST``: a one-token completion stream."""

    server: ThreadingHTTPServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        texts = self.server.metrics
        if self.path != "/metrics" or not texts:
            self.send_error(404)
            return
        body = (texts.pop(0) if len(texts) > 1 else texts[0]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for data in (
            {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        ):
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub() -> Iterator:
    """Starts stub servers, each with its scripted ``/metrics`` texts; returns their URLs."""
    servers = []

    def start(*metrics: str) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
        server.daemon_threads = True
        server.metrics = list(metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bench(tmp_path, url: str, *extra: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ("--base-url", url, "--model", "m", "--save-result", str(out), *WORKLOAD, *extra)
    assert run_cli("serve", *argv) == 0
    return json.loads(out.read_text())["result"]


def test_parse_reads_counters_and_gauges_only_of_the_kv_family():
    text = exposition({"blocks_received": 7, "loads": 2}, {"latency_p99_s": 0.5})
    assert parse_kv_metrics(text) == KVSnapshot(
        {"blocks_received": 7.0, "loads": 2.0}, {"latency_p99_s": 0.5}
    )


def test_serve_reports_kv_counter_deltas_of_each_server(stub, tmp_path, capsys):
    decode = stub(
        exposition(
            {"blocks_received": 10, "bytes_received": 4096, "failed_blocks": 1, "loads": 2},
            {"loading": 0, "latency_p50_s": 0.1, "latency_p99_s": 0.2},
        ),
        exposition(
            {"blocks_received": 16, "bytes_received": 6554, "failed_blocks": 1, "loads": 3},
            {"loading": 1, "latency_p50_s": 0.012, "latency_p99_s": 0.25},
        ),
    )
    idle = {"latency_p50_s": 0.0, "latency_p99_s": 0.0}  # a producer loads nothing
    prefill = stub(
        exposition({"blocks_sent": 4, "holds": 1, "loads": 0}, idle),
        exposition({"blocks_sent": 10, "holds": 3, "hold_timeouts": 1, "loads": 0}, idle),
    )
    result = bench(tmp_path, decode, "--kv-metrics-url", decode, prefill)

    assert result["kv_transfer"] == {
        decode: {
            "counters": {
                "blocks_received": 6,
                "bytes_received": 2458,
                "failed_blocks": 0,
                "loads": 1,
            },
            "latency": {"latency_p50_s": 0.012, "latency_p99_s": 0.25},
        },
        prefill: {
            # A counter that first shows up after the run counts from zero; the latency gauges
            # are left out when nothing was loaded.
            "counters": {"blocks_sent": 6, "holds": 2, "hold_timeouts": 1, "loads": 0},
            "latency": {},
        },
    }
    out = capsys.readouterr().out
    decode_block = out[out.index(f"==== KV transfer ({decode}) ====") :]
    assert "Blocks received:" in decode_block and "Latency p99 (s):" in decode_block
    prefill_block = out[out.index(f"==== KV transfer ({prefill}) ====") :]
    assert "Hold timeouts:" in prefill_block and "Latency" not in prefill_block


@pytest.mark.parametrize(
    "metrics", [(), (exposition({}, {}),)], ids=["no /metrics", "no connector"]
)
def test_serve_reports_nothing_without_kv_metrics(stub, tmp_path, capsys, metrics):
    url = stub(*metrics)
    result = bench(tmp_path, url)  # the target itself is scraped by default
    out = capsys.readouterr().out
    assert "Serving benchmark" in out
    assert "KV" not in out and "kv_transfer" not in result


def test_serve_names_an_explicit_url_without_kv_metrics(stub, tmp_path, capsys):
    url = stub(exposition({}, {}))
    result = bench(tmp_path, url, "--kv-metrics-url", url)
    assert f"no KV-transfer metrics at {url}/metrics" in capsys.readouterr().out
    assert "kv_transfer" not in result
