"""Helpers for the server tests: a tiny text model's engine config, the engine in the mode under
test, a live loopback server in a thread, and ``serve`` as a real process.

``PLATFORM_CORE_TEST_ENGINE_MODE`` (``process`` or ``thread``; default ``process``, what ``serve``
runs) chooses where the engines of the server tests run, ``serve`` processes included.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from engine_probe import EngineProbe

from platform_core.config import EngineConfig
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.launch import start_engine
from platform_core.engine.request_stream import SubmitFront
from platform_core.entrypoints.openai.api_server import ServerSettings, build_app, make_server
from platform_core.entrypoints.openai.limits import default_allowed_hosts

MODEL_NAME = "tiny-chat"
ENGINE_MODE = os.environ.get("PLATFORM_CORE_TEST_ENGINE_MODE", "process")
ENGINE_KEYS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_cache_memory_bytes": 1 << 22,
    "max_num_seqs": 64,
    "seed": 0,
    "block_size": 16,  # short test prompts still fill blocks (prefix-cache counters)
}


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    """The engine config every server test uses, for the model in ``model_dir``."""
    return EngineConfig.from_flat(model=str(model_dir), **{**ENGINE_KEYS, **overrides})


def start_test_engine(
    config: EngineConfig, probe: EngineProbe | None = None, mode: str | None = None
) -> SubmitFront:
    """The engine for ``config`` in ``mode`` (default ``ENGINE_MODE``), with ``probe`` on it."""
    return start_engine(config, mode or ENGINE_MODE, None if probe is None else probe.install)


def assert_engine_clean(engine: SubmitFront, probe: EngineProbe, timeout: float = 30) -> None:
    """Every request gone and every block back; the pool's bookkeeping is consistent."""
    wait_for(lambda: engine_idle(engine), timeout, f"blocks or requests leaked: {engine.stats()}")
    if isinstance(engine, AsyncEngine):
        engine.engine.check_kv_integrity()
    else:  # the check runs in the engine core's process
        probe.check_kv_integrity()


@contextmanager
def live_server(
    engine: SubmitFront,
    name: str = MODEL_NAME,
    settings: ServerSettings | None = None,
    send_buffer_bytes: int | None = None,
    **app_kwargs: Any,
) -> Iterator[str]:
    """Serve ``engine`` on a free 127.0.0.1 port in a background thread; yield the base URL.

    ``send_buffer_bytes`` fixes the kernel send buffer of every accepted connection (it stops
    autotuning), so a client that stops reading stalls the server's writes within kilobytes.

    The server is the one ``serve`` runs (``make_server``), with the Host allow-list a loopback
    server gets by default; ``settings`` default to ``serve``'s except that a dead engine does
    not stop the server (tests inspect it afterwards).
    """
    app_kwargs.setdefault("allowed_hosts", default_allowed_hosts("127.0.0.1"))
    app = build_app(engine, name, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if send_buffer_bytes is not None:  # accepted sockets inherit it from the listening one
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    settings = settings or ServerSettings(log_level="warning", exit_on_engine_death=False)
    with serving_in_thread(make_server(app, settings), sock) as url:
        yield url


@contextmanager
def serving_in_thread(server: Any, sock: socket.socket | None = None) -> Iterator[str]:
    """Run the uvicorn ``server`` in a background thread on ``sock`` (default: a new one),
    bound here to a free 127.0.0.1 port; yield the base URL, then stop it and check it did."""
    sock = sock or socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive(), "the server thread did not stop"


def wait_for(condition: Callable[[], bool], timeout: float, message: str) -> None:
    """Poll ``condition`` every 20 ms until true; fail with ``message`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.02)


def engine_idle(engine: SubmitFront) -> bool:
    """No request left in the engine and every KV block back in the pool."""
    stats = engine.stats()
    return stats["num_running"] + stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0


# What ``platform-core serve`` runs once the subcommand is wired into the main CLI; this calls
# the same parser function without depending on that wiring. ``{prelude}`` is test code run
# first (fault injection).
SERVE = """
import argparse, sys
{prelude}
from platform_core.cli.serve import add_serve_parser
parser = argparse.ArgumentParser()
add_serve_parser(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


@dataclass
class Served:
    """A ``serve`` process, its base URL and its log (stderr)."""

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_serve(
    model_dir: Path, log: Path, *flags: str, env: dict | None = None, prelude: str = ""
) -> Served:
    """Start ``serve`` for ``model_dir`` with the test engine settings on a free port (in
    ``ENGINE_MODE`` unless ``flags`` choose one)."""
    port = free_port()
    engine_flags = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_KEYS.items()]
    if not any(flag.startswith("--engine-mode") for flag in flags):
        engine_flags.append(f"--engine-mode={ENGINE_MODE}")
    script = SERVE.format(prelude=prelude)
    command = [sys.executable, "-c", script, "serve", "--model", str(model_dir)]
    process = subprocess.Popen(
        [*command, "--port", str(port), *engine_flags, *flags],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    return Served(process, f"http://127.0.0.1:{port}", log)


def post_raw(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    """POST ``body`` encoded with ``ensure_ascii`` (lone surrogates travel as ``\\ud800``)."""
    return httpx.post(
        url + path,
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def expect_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI error object of ``response``, asserting its status (and its param's start)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error
    return error
