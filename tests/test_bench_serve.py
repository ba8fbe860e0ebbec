"""``bench serve`` against a fake OpenAI-compatible streaming server on 127.0.0.1 whose delays
and chunking are known, so TTFT/ITL stamping and token counting are checked against them (as lower
bounds only: wall-clock upper bounds would be flaky on a loaded machine).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from bench_cli import run_cli

from platform_core.bench.workloads import (
    LengthRange,
    TokenSpace,
    WorkloadError,
    random_requests,
)

FIRST_DELAY, GAP = 0.15, 0.02


class FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` tokens after known delays; the model name picks a behaviour.

    ``pairs``: two tokens per chunk, usage in the last chunk. ``no-usage``: one token per chunk,
    no usage. ``fail``: HTTP 500. Anything else: one token per chunk plus usage.
    """

    server: ThreadingHTTPServer

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        with state["lock"]:
            state["bodies"].append(body)
            state["active"] += 1
            state["max_active"] = max(state["max_active"], state["active"])
        try:
            self._respond(body)
        finally:
            with state["lock"]:
                state["active"] -= 1

    def _send(self, payload):
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _respond(self, body):
        if body["model"] == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model exploded")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n, per_chunk = body["max_tokens"], 2 if body["model"] == "pairs" else 1
        time.sleep(FIRST_DELAY)
        for i in range(0, n, per_chunk):
            if i:
                time.sleep(GAP)
            self._send({"choices": [{"index": 0, "text": "ab"[:per_chunk], "finish_reason": None}]})
        self._send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if body["model"] != "no-usage":
            prompt = body["prompt"]
            prompt_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": prompt_len, "completion_tokens": n}
            self._send({"choices": [], "usage": usage})
        self._send("[DONE]")


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    server.daemon_threads = True
    server.state = {"lock": threading.Lock(), "bodies": [], "active": 0, "max_active": 0}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def serve_cli(server, tmp_path, model, *extra):
    out = tmp_path / f"serve-{model}.json"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    code = run_cli("serve", "--base-url", url, "--model", model, "--save-result", str(out), *extra)
    return code, json.loads(out.read_text())["result"]


def test_serve_streams_token_ids_and_times_tokens(fake_server, tmp_path, capsys):
    workload = ["--token-id-range", "10:50", "--num-prompts", "5", "--input-len", "3:6"]
    workload += ["--output-len", "6", "--max-concurrency", "2", "--goodput", "ttft:60000"]
    code, result = serve_cli(fake_server, tmp_path, "plain", *workload)
    assert code == 0
    assert "Median TPOT (ms)" in capsys.readouterr().out
    expected = random_requests(5, LengthRange(3, 6), LengthRange(6, 6), TokenSpace(10, 50), 0)
    bodies = sorted(fake_server.state["bodies"], key=lambda b: b["prompt"])
    assert bodies == sorted(
        (
            {
                "model": "plain",
                "prompt": r.prompt_token_ids,
                "max_tokens": 6,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            for r in expected
        ),
        key=lambda b: b["prompt"],
    )
    assert fake_server.state["max_active"] <= 2
    assert (result["completed"], result["failed"]) == (5, 0)
    assert result["total_input_tokens"] == sum(r.prompt_len for r in expected)
    assert result["total_output_tokens"] == 30
    assert result["ttft_ms"]["mean"] >= FIRST_DELAY * 1000
    assert result["itl_ms"]["median"] >= GAP * 1000 * 0.5
    assert result["e2el_ms"]["mean"] >= result["ttft_ms"]["mean"]
    assert result["good_requests"] == 5
    assert result["goodput"] == pytest.approx(result["request_throughput"])


def test_serve_counts_tokens_from_usage_then_chunks(fake_server, tmp_path):
    workload = ["--token-id-range", "10:50", "--num-prompts", "2", "--output-len", "6"]
    _, paired = serve_cli(fake_server, tmp_path, "pairs", *workload, "--goodput", "ttft:1")
    assert paired["total_output_tokens"] == 12  # usage says 6 each, though only 3 chunks came
    assert paired["good_requests"] == 0  # TTFT is at least FIRST_DELAY, far above 1 ms
    # TPOT uses the usage count: (latency - ttft) / 5, while the 2 gaps per request are ITLs.
    assert paired["tpot_ms"]["mean"] * 5 == pytest.approx(
        paired["e2el_ms"]["mean"] - paired["ttft_ms"]["mean"]
    )
    _, counted = serve_cli(fake_server, tmp_path, "no-usage", *workload)
    assert counted["total_output_tokens"] == 12  # six one-token chunks each
    assert counted["total_input_tokens"] == 2 * 128  # the known prompt lengths


def test_serve_text_prompts_and_failures(fake_server, tmp_path, capsys):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "one two three", "max_tokens": 2}\n')
    code, result = serve_cli(
        fake_server, tmp_path, "plain", "--workload", "jsonl", "--dataset-path", str(dataset)
    )
    assert code == 0 and fake_server.state["bodies"][-1]["prompt"] == "one two three"
    assert result["total_input_tokens"] == 3  # from the server's usage
    code, result = serve_cli(
        fake_server, tmp_path, "fail", "--token-id-range", "1:9", "--num-prompts", "3"
    )
    assert code == 1
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["errors"] == ["HTTP 500: model exploded"]
    assert "error: HTTP 500" in capsys.readouterr().out


def test_serve_random_workload_needs_a_vocabulary(tmp_path):
    with pytest.raises(WorkloadError, match="--tokenizer or --token-id-range"):
        run_cli("serve", "--model", "m", "--base-url", "http://127.0.0.1:9")
