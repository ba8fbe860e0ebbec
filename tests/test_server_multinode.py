"""A front and a headless engine host in two network namespaces joined by a veth pair: requests
served end to end over tcp, a wrong secret refused, the engine host's death a clear error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from server_utils import ENGINE_KEYS, SERVE

SUBNET = f"10.231.{os.getpid() % 200 + 20}"
FRONT_IP, ENGINE_IP = f"{SUBNET}.1", f"{SUBNET}.2"
RPC_PORT, HTTP_PORT = 13345, 18000
ENGINE_FLAGS = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_KEYS.items()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def namespaces():
    tag = os.getpid() % 100000
    front, engine = f"pcf{tag}", f"pce{tag}"
    try:
        _ip("netns", "add", front)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"'ip netns' is not permitted here: {getattr(exc, 'stderr', exc)}")
    try:
        _ip("netns", "add", engine)
        _ip("link", "add", f"vf{tag}", "type", "veth", "peer", "name", f"ve{tag}")
        for ns, dev, address in ((front, f"vf{tag}", FRONT_IP), (engine, f"ve{tag}", ENGINE_IP)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield front, engine
    finally:
        for ns in (front, engine):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _serve(ns: str, log, *flags: str) -> subprocess.Popen:
    command = ["ip", "netns", "exec", ns, sys.executable, "-c", SERVE.format(prelude=""), "serve"]
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
    return ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, what, str(HTTP_PORT), *args]


def _client(ns: str, *args: str, timeout: float = 300) -> str:
    run = _client_command(ns, *args)
    return subprocess.run(run, capture_output=True, text=True, timeout=timeout).stdout


def test_a_front_serves_through_a_headless_engine_host_in_another_namespace(
    namespaces, model_dir, tmp_path
):
    front_ns, engine_ns = namespaces
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
        FRONT_IP,
        "--engine-secret-file",
        str(tmp_path / "secret"),
    )
    engine_flags = ["--model", str(model_dir), "--headless", *dp]
    engine_flags += ["--data-parallel-address", FRONT_IP]
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
