"""Helpers for the proxy tests: any ASGI app (a stub instance, the proxy) served on a free
loopback port in a thread, and ``live_proxy`` in front of given prefill and decode URLs (stub
instances here; real ``serve`` processes in an end-to-end test)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import uvicorn
from server_utils import serving_in_thread

from platform_core.entrypoints.proxy.app import build_proxy_app
from platform_core.entrypoints.proxy.config import ProxyConfig


@contextmanager
def live_app(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port in a background thread; yield the
    base URL. Streams still open at the end are cut after a second."""
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    with serving_in_thread(uvicorn.Server(config)) as url:
        yield url


@contextmanager
def live_proxy(prefill: Sequence[str], decode: Sequence[str], **options: Any) -> Iterator[str]:
    """The proxy before ``prefill`` and ``decode`` instances (``ProxyConfig`` ``options``),
    served by ``live_app``; yield its base URL."""
    config = ProxyConfig(tuple(prefill), tuple(decode), **options)
    with live_app(build_proxy_app(config)) as url:
        yield url
