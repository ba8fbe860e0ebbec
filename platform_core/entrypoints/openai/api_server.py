"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI routes) and ``run_server`` (uvicorn).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/health`` (always open), ``/version``, ``/metrics`` (open unless guarded).
The engine runs on its own thread (``AsyncEngine``); this module only wires HTTP to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from platform_core import __version__
from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.data_parallel import DataParallelEngine
from platform_core.entrypoints.openai.errors import error_response, install_error_handlers
from platform_core.entrypoints.openai.limits import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES
from platform_core.entrypoints.openai.metrics import ServerMetrics
from platform_core.entrypoints.openai.middleware import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
)
from platform_core.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from platform_core.entrypoints.openai.serving_base import ServerContext
from platform_core.entrypoints.openai.serving_chat import ChatServing, chat_prompt_ids
from platform_core.entrypoints.openai.serving_completion import CompletionServing
from platform_core.models.packaged import DEFAULT_MODEL

logger = logging.getLogger("platform_core.server")


def build_app(
    engine: AsyncEngine | DataParallelEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    guard_metrics: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``engine`` under ``served_model_name``.

    With ``api_key`` every route but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>``; ``guard_metrics`` guards ``/metrics`` too.
    The app does not own the engine: whoever created the engine shuts it down.
    """
    ctx = ServerContext(engine, served_model_name, ServerMetrics(engine))
    completions = CompletionServing(ctx)
    chat = ChatServing(ctx)
    app = FastAPI(title="platform-core", version=__version__, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        reason = str(engine.error) if engine.error else "the engine is not running"
        return error_response(503, reason, code="engine_unavailable")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "platform-core",
            "root": str(engine.engine.model_dir),
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        if body.messages is not None:
            tokens = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
        else:
            tokens = ctx.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        return JSONResponse({"prompt": ctx.decode(body.tokens)})

    # Added last = outermost: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = OPEN_PATHS - {"/metrics"} if guard_metrics else OPEN_PATHS
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    return app


def default_model_name(model: str | None) -> str:
    """The name clients use for ``model``: the packaged model's name, else the model string."""
    return model or DEFAULT_MODEL


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, then drain and stop (exit status 0)."""
    import uvicorn

    from platform_core.entrypoints.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    name = args.served_model_name or default_model_name(config.model.model)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if config.parallel.data_parallel_size > 1:
        engine = DataParallelEngine.from_config(config)
    else:
        engine = AsyncEngine.from_config(config)
    try:
        app = build_app(
            engine,
            name,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            guard_metrics=args.guard_metrics,
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=getattr(args, "log_level", "info").lower(),
                timeout_graceful_shutdown=args.shutdown_timeout,
            )
        )
        # uvicorn drains requests on SIGTERM, then raises the signal again: make that a
        # KeyboardInterrupt (as for SIGINT) so the engine below is stopped, not killed.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        logger.info("serving %r on http://%s:%d", name, args.host, args.port)
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0
