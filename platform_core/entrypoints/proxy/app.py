"""The proxy's HTTP app (``build_proxy_app``) and its server (``run_proxy``).

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (``disagg``), ``/v1/models`` (a decode
instance's), ``/health`` (200 while every side has a healthy instance, else 503; each
upstream's status either way, as the health checker last found it) and ``/metrics``
(Prometheus text).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from platform_core import __version__
from platform_core.entrypoints.openai.errors import install_error_handlers
from platform_core.entrypoints.openai.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from platform_core.entrypoints.proxy.config import ProxyConfig
from platform_core.entrypoints.proxy.disagg import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MODELS,
    Disaggregator,
)
from platform_core.entrypoints.proxy.health import HealthChecker, health_report
from platform_core.entrypoints.proxy.metrics import ProxyMetrics
from platform_core.entrypoints.proxy.routing import UpstreamPool

# Routes open without the proxy's API key: probes and the Prometheus scrape.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    """The proxy's FastAPI app for ``config``. Starting, it asks every upstream's ``/health``
    once, then polls them in the background; its upstream client closes with the app."""
    prefill = UpstreamPool("prefill", config.prefill, config.routing)
    decode = UpstreamPool("decode", config.decode, config.routing)
    pools = (prefill, decode)
    metrics = ProxyMetrics(pools)
    # Generation has no time limit here (the instances have theirs); connecting has one, so a
    # down instance is quickly left for another (or a 502). Connections are not capped: the
    # instances queue requests.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=config.connect_timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
        trust_env=False,  # the instances are reached directly, never through $HTTP_PROXY
    )
    disagg = Disaggregator(client, prefill, decode, metrics)
    checker = HealthChecker(client, pools, config.health_interval, config.health_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await checker.check()  # no request is routed to an instance found down at the start
        polling = asyncio.create_task(checker.run())
        try:
            yield
        finally:
            polling.cancel()
            with suppress(asyncio.CancelledError):
                await polling
            await client.aclose()

    app = FastAPI(
        title="platform-core proxy",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    install_error_handlers(app)

    @app.post(COMPLETIONS.path)
    async def completions(request: Request) -> Response:
        return await disagg.generate(COMPLETIONS, request)

    @app.post(CHAT_COMPLETIONS.path)
    async def chat_completions(request: Request) -> Response:
        return await disagg.generate(CHAT_COMPLETIONS, request)

    @app.get(MODELS)
    async def models(request: Request) -> Response:
        return await disagg.models(request)

    @app.get("/health")
    async def health() -> Response:
        healthy, report = health_report(pools)
        return JSONResponse(report, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=OPEN_PATHS)
    return app


def run_proxy(config: ProxyConfig, host: str, port: int, log_level: str = "info") -> int:
    """Serve the proxy on ``host:port`` until SIGINT/SIGTERM; the exit status."""
    app = build_proxy_app(config)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower())).run()
    return 0
