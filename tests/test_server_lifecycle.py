"""``serve`` as a real process: flags, API key from the environment, graceful SIGTERM/SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_utils import ENGINE_KEYS, wait_for
from text_model import save_text_model

# What ``platform-core serve`` runs once the subcommand is wired into the main CLI; this calls
# the same parser function without depending on that wiring.
SERVE = """
import argparse, sys
from platform_core.cli.serve import add_serve_parser
parser = argparse.ArgumentParser()
add_serve_parser(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


@dataclass
class Served:
    process: subprocess.Popen
    url: str
    log: Path

    def healthy(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(model_dir: Path, log: Path, *flags: str, env: dict | None = None) -> Served:
    port = _free_port()
    engine_flags = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_KEYS.items()]
    command = [sys.executable, "-c", SERVE, "serve", "--model", str(model_dir)]
    process = subprocess.Popen(
        [*command, "--port", str(port), *engine_flags, *flags],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    return Served(process, f"http://127.0.0.1:{port}", log)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers, started together (start-up is mostly imports and model loading)."""
    model_dir = save_text_model(tmp_path_factory.mktemp("lifecycle-model"))
    logs = tmp_path_factory.mktemp("logs")
    started = {
        "plain": _launch(model_dir, logs / "plain.log"),
        "keyed": _launch(
            model_dir,
            logs / "keyed.log",
            "--served-model-name",
            "my-model",
            env={"PLATFORM_CORE_API_KEY": "k3y"},
        ),
    }
    try:
        for served in started.values():
            wait_for(served.healthy, 120, "a server did not become healthy")
        yield model_dir, started
    finally:
        for served in started.values():
            served.stop()


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_cleanly(servers):
    model_dir, started = servers
    served = started["plain"]
    url = served.url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [str(model_dir)]
    children = _children(served.process.pid)
    first_event, events = threading.Event(), []

    def stream():
        body = {"prompt": "The capital of", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_event.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_event.wait(60)
    served.process.send_signal(signal.SIGTERM)
    reader.join(60)
    assert served.process.wait(60) == 0, served.log.read_text()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"  # finished, not cut off
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children), "orphaned processes"


def test_sigint_stops_a_server_whose_key_comes_from_the_environment(servers):
    served = servers[1]["keyed"]
    assert httpx.get(served.url + "/v1/models").status_code == 401
    models = httpx.get(served.url + "/v1/models", headers={"authorization": "Bearer k3y"}).json()
    assert [m["id"] for m in models["data"]] == ["my-model"]
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(60) == 0, served.log.read_text()
