"""A front and a headless engine host in two network namespaces joined by a veth pair: requests
served end to end over tcp, a wrong secret refused, the engine host's death a clear error."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from netns import host_pair, in_namespace
from server_utils import ENGINE_KEYS, SERVE

RPC_PORT, HTTP_PORT = 13345, 18000
ENGINE_FLAGS = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_KEYS.items()]


@pytest.fixture(scope="module")
def hosts():
    with host_pair("pc", 231) as pair:
        yield pair


def _serve(ns: str, log, *flags: str) -> subprocess.Popen:
    command = in_namespace(ns, sys.executable, "-c", SERVE.format(prelude=""), "serve")
    return subprocess.Popen(
        [*command, *ENGINE_FLAGS, *flags], stdout=subprocess.DEVNULL, stderr=log.open("w")
    )


# Run inside the front's namespace: the HTTP server listens on its loopback.
CLIENT = """
import httpx, json, sys, time
url = "http://127.0.0.1:" + sys.argv[2]
what = sys.argv[1]
if what == "health":
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                print("healthy"); sys.exit(0)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    print("unhealthy")
elif what == "complete":
    body = {"prompt": "The capital of", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    print(json.dumps({"status": r.status_code, "body": r.json()}))
else:
    body = {"prompt": "Once", "max_tokens": 250, "ignore_eos": True, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 1:
                    print("streaming", flush=True)
    except httpx.TransportError as exc:
        lines.append("transport error: %r" % exc)
    print(json.dumps([line for line in lines if line]))
"""


def _client_command(ns: str, what: str, *args: str) -> list[str]:
    return in_namespace(ns, sys.executable, "-c", CLIENT, what, str(HTTP_PORT), *args)


def _client(ns: str, *args: str, timeout: float = 300) -> str:
    run = _client_command(ns, *args)
    return subprocess.run(run, capture_output=True, text=True, timeout=timeout).stdout


def test_a_front_serves_through_a_headless_engine_host_in_another_namespace(
    hosts, model_dir, tmp_path
):
    front_ns, engine_ns = hosts.first, hosts.second
    (tmp_path / "secret").write_text("the-shared-secret\n")
    (tmp_path / "wrong").write_text("not-the-secret\n")
    front_flags = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(HTTP_PORT)]
    dp = ["--data-parallel-size", "1", "--data-parallel-rpc-port", str(RPC_PORT)]
    front = _serve(
        front_ns,
        tmp_path / "front.log",
        *front_flags,
        *dp,
        "--data-parallel-size-local=0",
        "--data-parallel-address",
        hosts.first_ip,
        "--engine-secret-file",
        str(tmp_path / "secret"),
    )
    engine_flags = ["--model", str(model_dir), "--headless", *dp]
    engine_flags += ["--data-parallel-address", hosts.first_ip]
    processes = [front]
    try:
        impostor = _serve(
            engine_ns,
            tmp_path / "impostor.log",
            *engine_flags,
            "--engine-secret-file",
            str(tmp_path / "wrong"),
        )
        processes.append(impostor)
        assert impostor.wait(240) != 0
        assert "does not know the shared engine secret" in (tmp_path / "impostor.log").read_text()
        assert front.poll() is None
        assert _client(front_ns, "health", "2").strip() == "unhealthy"  # nothing serves yet

        engine = _serve(
            engine_ns,
            tmp_path / "engine.log",
            *engine_flags,
            "--engine-secret-file",
            str(tmp_path / "secret"),
        )
        processes.append(engine)
        healthy = _client(front_ns, "health", "240").strip()
        assert healthy == "healthy", (tmp_path / "front.log").read_text()
        answer = json.loads(_client(front_ns, "complete"))
        assert answer["status"] == 200, answer
        assert answer["body"]["usage"]["completion_tokens"] == 8

        reader = subprocess.Popen(
            _client_command(front_ns, "stream"), stdout=subprocess.PIPE, text=True
        )
        processes.append(reader)
        assert reader.stdout.readline().strip() == "streaming"
        engine.send_signal(signal.SIGKILL)
        events = json.loads(reader.communicate(timeout=120)[0])
        tokens = sum('"text"' in event for event in events)
        assert tokens < 250, f"the stream finished before the engine host died: {events[-3:]}"
        errors = [e for e in events if '"error"' in e or "transport error" in e]
        assert errors and "engine core" in errors[-1], events[-3:]
        assert front.wait(120) == 3, (tmp_path / "front.log").read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
