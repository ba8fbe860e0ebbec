"""Disaggregated serving end to end: a prefill and a decode ``serve`` process joined by the TCP
connector (on different backends: their KV layouts differ), behind ``platform-core proxy``,
driven by the real ``openai`` client. Answers must equal a colocated answer (the prefill
instance asked directly, which computes the whole request itself: the decode instance would find
the loaded blocks in its prefix cache), blocks must move, and both instances must end with every
block free. A second run puts the two instances in two network namespaces, each its own
address."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from netns import host_pair, in_namespace
from server_utils import ENGINE_KEYS, MODEL_NAME, Served, free_port, wait_for

PROMPT = "The history of the printing press begins " * 6
MESSAGES = [{"role": "user", "content": "Tell me about block caches and how they are shared."}]


def start(argv: list[str], url: str, log: Path, prefix: list[str] = ()) -> Served:
    """``platform-core ARGV`` as a process (inside a network namespace with ``prefix``)."""
    command = [*prefix, sys.executable, "-m", "platform_core.cli.main", *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    return Served(process, url, log)


def serve_argv(model_dir: Path, host: str, port: int, backend: str, transfer: dict) -> list[str]:
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_KEYS.items()]
    return [
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--backend",
        backend,
        f"--kv-transfer-config={json.dumps(transfer)}",
        "--engine-mode=thread",  # one process per instance: quicker to start
        *flags,
    ]


def metric(url: str, name: str) -> float:
    """The value of an unlabelled metric in ``url``'s /metrics (a counter's ``_total``)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith((name + " ", name + "_total ")):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}/metrics")


@pytest.fixture(scope="module")
def stack(text_model_dir: Path, tmp_path_factory) -> Iterator[dict[str, Served]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    prefill_port, decode_port, kv_port, proxy_port = (free_port() for _ in range(4))
    producer = {"kv_connector": "tcp", "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {"kv_connector": "tcp", "kv_role": "kv_consumer"}
    host = "127.0.0.1"
    prefill = start(
        serve_argv(text_model_dir, host, prefill_port, "cpu", producer),
        f"http://{host}:{prefill_port}",
        logs / "prefill.log",
    )
    decode = start(
        serve_argv(text_model_dir, host, decode_port, "template", consumer),
        f"http://{host}:{decode_port}",
        logs / "decode.log",
    )
    proxy = start(
        ["proxy", "--prefill", prefill.url, "--decode", decode.url, "--port", str(proxy_port)],
        f"http://{host}:{proxy_port}",
        logs / "proxy.log",
    )
    processes = {"prefill": prefill, "decode": decode, "proxy": proxy}
    try:
        for process in processes.values():
            wait_for(process.healthy, 120, f"{process.url} did not come up")
        yield processes
    finally:
        for process in processes.values():
            process.stop()


def settled(url: str) -> bool:
    return (
        metric(url, "platform_core_kv_transfer_held") == 0
        and metric(url, "platform_core_kv_transfer_loading") == 0
        and metric(url, "platform_core_kv_cache_usage_perc") == 0
    )


def test_disaggregated_answers_equal_colocated_ones(stack):
    proxy = openai.OpenAI(base_url=stack["proxy"].url + "/v1", api_key="none")
    direct = openai.OpenAI(base_url=stack["prefill"].url + "/v1", api_key="none")
    greedy = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 12}
    answer = proxy.completions.create(prompt=PROMPT, **greedy)
    colocated = direct.completions.create(prompt=PROMPT, **greedy)
    assert answer.choices[0].text == colocated.choices[0].text
    assert metric(stack["decode"].url, "platform_core_kv_transfer_blocks_received") > 0
    assert metric(stack["prefill"].url, "platform_core_kv_transfer_blocks_sent") > 0

    stream = proxy.chat.completions.create(messages=MESSAGES, stream=True, **greedy)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    expected = direct.chat.completions.create(messages=MESSAGES, **greedy)
    assert streamed == expected.choices[0].message.content
    for side in ("prefill", "decode"):
        url = stack[side].url
        wait_for(lambda url=url: settled(url), 30, f"{side} kept blocks")
    assert metric(stack["decode"].url, "platform_core_kv_transfer_failed_blocks") == 0


def test_disaggregation_across_two_network_namespaces(text_model_dir: Path, tmp_path: Path):
    """The prefill instance on one "host", the decode instance, the proxy and the client on
    another: the decode side reaches the producer at its own address, never at loopback."""
    with host_pair("pd", 233) as pair:
        prefill_port, decode_port, kv_port, proxy_port = (free_port() for _ in range(4))
        producer = {
            "kv_connector": "tcp",
            "kv_role": "kv_producer",
            "kv_ip": pair.first_ip,
            "kv_port": kv_port,
        }
        consumer = {"kv_connector": "tcp", "kv_role": "kv_consumer"}
        prefill_url = f"http://{pair.first_ip}:{prefill_port}"
        decode_url = f"http://127.0.0.1:{decode_port}"
        processes = [
            start(
                serve_argv(text_model_dir, pair.first_ip, prefill_port, "cpu", producer),
                prefill_url,
                tmp_path / "prefill.log",
                in_namespace(pair.first),
            ),
            start(
                serve_argv(text_model_dir, "127.0.0.1", decode_port, "cpu", consumer),
                decode_url,
                tmp_path / "decode.log",
                in_namespace(pair.second),
            ),
            start(
                [
                    "proxy",
                    "--prefill",
                    prefill_url,
                    "--decode",
                    decode_url,
                    "--port",
                    str(proxy_port),
                ],
                f"http://127.0.0.1:{proxy_port}",
                tmp_path / "proxy.log",
                in_namespace(pair.second),
            ),
        ]
        try:
            result = subprocess.run(
                in_namespace(
                    pair.second,
                    sys.executable,
                    "-c",
                    CLIENT,
                    str(proxy_port),
                    prefill_url,
                    str(decode_port),
                    MODEL_NAME,
                    PROMPT,
                ),
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert result.returncode == 0, result.stderr[-3000:] + _logs(processes)
            answers = json.loads(result.stdout)
            assert answers["disaggregated"] == answers["colocated"]
            assert answers["blocks_received"] > 0
        finally:
            for process in processes:
                process.stop()


def _logs(processes: list[Served]) -> str:
    return "".join(f"\n--- {p.log.name}\n{p.log.read_text()[-2000:]}" for p in processes)


# Runs inside the second namespace: waits for the three services, asks through the proxy and
# the prefill instance directly, prints the answers and the decode side's received blocks.
CLIENT = """
import json, sys, time
import httpx, openai
proxy_port, prefill_url, decode_port, model, prompt = sys.argv[1:6]
proxy_url, decode_url = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{decode_port}"
deadline = time.monotonic() + 180
while True:
    try:
        if httpx.get(proxy_url + "/health", timeout=1).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the services did not come up")
    time.sleep(0.5)
greedy = {"model": model, "temperature": 0.0, "max_tokens": 12}
via_proxy = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none")
direct = openai.OpenAI(base_url=prefill_url + "/v1", api_key="none")
disaggregated = via_proxy.completions.create(prompt=prompt, **greedy).choices[0].text
colocated = direct.completions.create(prompt=prompt, **greedy).choices[0].text
received = 0.0
for line in httpx.get(decode_url + "/metrics").text.splitlines():
    if line.startswith("platform_core_kv_transfer_blocks_received_total "):
        received = float(line.split()[1])
print(json.dumps({"disaggregated": disaggregated, "colocated": colocated,
                  "blocks_received": received}))
"""
