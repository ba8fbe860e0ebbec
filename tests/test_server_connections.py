"""Connections and exposure over loopback (issue #27): read timeouts, the Host allow-list,
empty API keys, no disk paths in answers, and exiting when the engine dies."""

from __future__ import annotations

import argparse
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_utils import MODEL_NAME, expect_error, launch_serve, live_server, wait_for

from platform_core.entrypoints.openai.api_server import ServerSettings, api_key_from, build_app
from platform_core.entrypoints.openai.limits import default_allowed_hosts
from platform_core.errors import ConfigError


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (recv returns b"") within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_connections_that_do_not_send_a_whole_request_are_closed(engine, steps):
    settings = ServerSettings(log_level="warning", read_timeout=0.5, exit_on_engine_death=False)
    with live_server(engine, settings=settings) as url:
        address = urlsplit(url)
        stalls = [
            b"",  # connects, sends nothing
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",  # half headers
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b'\r\nContent-Length: 100\r\n\r\n{"prompt":',  # stalled body
        ]
        for sent in stalls:
            with socket.create_connection((address.hostname, address.port)) as sock:
                sock.sendall(sent)
                started = time.monotonic()
                assert _closed_within(sock, 5), f"still open after 5 s: {sent!r}"
                assert time.monotonic() - started < 3
        # Trickling one byte at a time does not restart the clock.
        with socket.create_connection((address.hostname, address.port)) as sock:
            started = time.monotonic()
            for byte in b"GET /health HTTP/1.1\r\n":
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.1)
            assert _closed_within(sock, 5) and time.monotonic() - started < 4
        # A response taking longer than the read timeout is not cut, and a kept-alive
        # connection that pauses between requests still works.
        steps.delay = 0.05
        body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) == 31
            time.sleep(1.0)
            assert client.get("/health").status_code == 200


def test_only_allowed_hosts_are_answered(engine):
    with live_server(engine) as url:  # loopback defaults
        port = urlsplit(url).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            response = httpx.get(url + "/health", headers={"host": host})
            assert expect_error(response, 400)["code"] == "invalid_host", host
    with live_server(engine, allowed_hosts=("api.example",)) as url:
        assert httpx.get(url + "/health", headers={"host": "API.example:80"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 400  # 127.0.0.1 is not listed
    with live_server(engine, allowed_hosts=("*",)) as url:
        assert httpx.get(url + "/health", headers={"host": "anything"}).status_code == 200


def test_default_allowed_hosts_depend_on_the_bound_address():
    assert set(default_allowed_hosts("127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}
    assert "127.0.0.2" in default_allowed_hosts("127.0.0.2")
    assert set(default_allowed_hosts("::1")) == {"localhost", "127.0.0.1", "::1"}
    assert default_allowed_hosts("0.0.0.0") == ("*",)
    assert default_allowed_hosts("192.168.1.5") == ("*",)


def test_an_empty_api_key_is_an_error(engine, monkeypatch, tmp_path):
    monkeypatch.delenv("PLATFORM_CORE_API_KEY", raising=False)
    assert api_key_from(argparse.Namespace(api_key=None)) is None
    assert api_key_from(argparse.Namespace(api_key="k")) == "k"
    with pytest.raises(ConfigError, match="--api-key is empty"):
        api_key_from(argparse.Namespace(api_key=""))
    monkeypatch.setenv("PLATFORM_CORE_API_KEY", "")
    with pytest.raises(ConfigError, match="PLATFORM_CORE_API_KEY is empty"):
        api_key_from(argparse.Namespace(api_key=None))
    with pytest.raises(ConfigError):
        build_app(engine, MODEL_NAME, api_key="")
    # ``serve`` refuses before loading the model.
    served = launch_serve(tmp_path / "no-model", tmp_path / "serve.log", "--api-key", "")
    try:
        assert served.process.wait(120) != 0
        assert "--api-key is empty" in served.log.read_text()
    finally:
        served.stop()


def test_answers_do_not_reveal_the_models_path(engine, model_dir):
    model_path = str(model_dir)
    with live_server(engine) as url:
        models = httpx.get(url + "/v1/models")
        assert model_path not in models.text
        assert models.json()["data"][0]["root"] == MODEL_NAME
    with live_server(engine, name=model_path) as url:  # the default name of a path --model
        response = httpx.post(url + "/v1/completions", json={"prompt": "x", "model": "nope"})
        error = expect_error(response, 404, "model")
        assert model_path not in error["message"] and "nope" in error["message"]


DYING_ENGINE = """
from platform_core.engine.llm_engine import LLMEngine
def step(self):
    raise RuntimeError("tensor-parallel worker 1 died")
LLMEngine.step = step
"""


def test_serve_exits_non_zero_when_the_engine_loop_dies(text_model_dir, tmp_path):
    # In thread mode: the prelude patches the engine in serve's own process (an engine core
    # process imports a fresh one; its death by signal is test_engine_core_kill.py's).
    served = launch_serve(
        text_model_dir, tmp_path / "serve.log", "--engine-mode=thread", prelude=DYING_ENGINE
    )
    try:
        wait_for(served.healthy, 120, "the server did not become healthy")
        response = httpx.post(served.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert response.status_code == 503, response.text
        assert served.process.wait(15) == 3
        log = served.log.read_text()
        assert "the engine stopped serving" in log and "worker 1 died" in log
    finally:
        served.stop()
