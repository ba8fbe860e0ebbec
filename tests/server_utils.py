"""Helpers for the server tests: a tiny text model's engine config and a live loopback server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.async_engine import AsyncEngine
from platform_core.entrypoints.openai.api_server import ServerSettings, build_app, make_server
from platform_core.entrypoints.openai.limits import default_allowed_hosts

MODEL_NAME = "tiny-chat"
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


@contextmanager
def live_server(
    engine: AsyncEngine,
    name: str = MODEL_NAME,
    settings: ServerSettings | None = None,
    **app_kwargs: Any,
) -> Iterator[str]:
    """Serve ``engine`` on a free 127.0.0.1 port in a background thread; yield the base URL.

    The server is the one ``serve`` runs (``make_server``), with the Host allow-list a loopback
    server gets by default; ``settings`` default to ``serve``'s except that a dead engine does
    not stop the server (tests inspect it afterwards).
    """
    app_kwargs.setdefault("allowed_hosts", default_allowed_hosts("127.0.0.1"))
    app = build_app(engine, name, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = settings or ServerSettings(log_level="warning", exit_on_engine_death=False)
    server = make_server(app, settings)
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


def engine_idle(engine: AsyncEngine) -> bool:
    """No request left in the engine and every KV block back in the pool."""
    stats = engine.stats()
    return stats["num_running"] + stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
