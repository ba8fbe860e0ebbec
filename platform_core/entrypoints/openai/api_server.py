"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI routes), ``make_server`` (uvicorn,
with the read timeout, the shutdown drain and the engine-death watch) and ``run_server``.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/invocations`` and ``/ping`` (SageMaker's), ``/tokenizer_info`` (when enabled),
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's), ``/health`` (always open),
``/version``, ``/metrics`` (open unless guarded).
The engine core runs in its own process (``ProcessEngine``; ``--engine-mode thread``: on a thread,
``AsyncEngine``); this module only wires HTTP to it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.responses import Response

from platform_core import __version__
from platform_core.config import EngineConfig
from platform_core.engine.launch import start_engine
from platform_core.engine.request_stream import SubmitFront
from platform_core.entrypoints.openai import serving_tokenize
from platform_core.entrypoints.openai.body import JsonBodyRoute
from platform_core.entrypoints.openai.connection import ReadTimeoutH11Protocol
from platform_core.entrypoints.openai.errors import error_response, install_error_handlers
from platform_core.entrypoints.openai.limits import (
    ANY_HOST,
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_TOKENIZER_THREADS,
    RequestLimits,
    default_allowed_hosts,
)
from platform_core.entrypoints.openai.metrics import ServerMetrics
from platform_core.entrypoints.openai.middleware import (
    OPEN_PATHS,
    AllowedHostsMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RootPathMiddleware,
)
from platform_core.entrypoints.openai.prepare import Preparer
from platform_core.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from platform_core.entrypoints.openai.serving_base import ServerContext, ServingOptions
from platform_core.entrypoints.openai.serving_chat import ChatServing
from platform_core.entrypoints.openai.serving_completion import CompletionServing
from platform_core.entrypoints.openai.serving_models import ServedModels, served_models
from platform_core.errors import ConfigError, InvalidRequestError
from platform_core.models.packaged import DEFAULT_MODEL

logger = logging.getLogger("platform_core.server")

# Exit status of ``serve`` when it stopped because the engine died (--exit-on-engine-death).
ENGINE_DEATH_EXIT_STATUS = 3
# uvicorn's own cut-off comes this long after the drain deadline: it only catches a response
# that could not even send its error (a client that stopped reading).
SHUTDOWN_GRACE_SECONDS = 5.0


def build_app(
    engine: SubmitFront,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    guard_metrics: bool = False,
    allowed_hosts: tuple[str, ...] = (ANY_HOST,),
    limits: RequestLimits | None = None,
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
    strict_request_fields: bool = False,
    return_tokens_as_token_ids: bool = False,
    enable_force_include_usage: bool = False,
    trust_request_chat_template: bool = False,
    root_path: str = "",
    enable_tokenizer_info_endpoint: bool = False,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    models: ServedModels | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine`` under ``served_model_name``, and its LoRA adapters
    under theirs when ``models`` (``served_models``) has some.

    With ``api_key`` every route but ``/health``, ``/ping`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>``; ``guard_metrics`` guards ``/metrics`` too. A request
    whose ``Host`` is not in ``allowed_hosts`` gets 400 (``"*"`` allows any). The protocol
    switches are ``ServingOptions``'. ``root_path`` is the prefix a proxy serves the app under
    (routes answer with and without it). The app does not own the engine: whoever created the
    engine shuts it down.
    """
    if api_key is not None and not api_key:
        raise ConfigError("the API key is empty; give a non-empty key, or none for no auth")
    models = models or ServedModels(served_model_name)
    if models.base_name != served_model_name:
        raise ConfigError(
            f"the served models are for {models.base_name!r}, not {served_model_name!r}"
        )
    preparer = Preparer(
        engine.tokenizer, engine.vocab_size, engine.max_model_len, tokenizer_threads
    )
    options = ServingOptions(
        strict_request_fields,
        return_tokens_as_token_ids,
        enable_force_include_usage,
        trust_request_chat_template,
        reasoning_parser,
        tool_call_parser,
        enable_auto_tool_choice,
    )
    ctx = ServerContext(
        engine,
        models,
        ServerMetrics(engine, served_model_name),
        preparer,
        limits or RequestLimits(),
        options,
    )
    completions = CompletionServing(ctx)
    chat = ChatServing(ctx)
    root_path = root_path.rstrip("/")
    app = FastAPI(title="platform-core", version=__version__, docs_url=None, redoc_url=None)
    app.router.route_class = JsonBodyRoute
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
    async def list_models() -> dict:
        return {"object": "list", "data": models.cards(ctx.created, engine.max_model_len)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        """Serve the PEFT adapter at ``lora_path`` (a directory on the server's disk) as the
        model ``lora_name``; it is checked now (400 with the reason if it cannot be served)."""
        ctx.check_fields(body, "/v1/load_lora_adapter")
        lora = await models.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter (404 if none has that name or id). Requests already
        accepted with it finish normally (each carries its adapter to the engine); new
        requests naming it get 404. Loading it again gives it a new id."""
        ctx.check_fields(body, "/v1/unload_lora_adapter")
        lora = models.unload(body.lora_name, body.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving_tokenize.tokenize(ctx, body)

    if enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(serving_tokenize.tokenizer_info(engine.tokenizer))

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        body = await invocation_body(request)
        if isinstance(body, ChatCompletionRequest):
            return await chat.create(body, request)
        return await completions.create(body, request)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        return JSONResponse({"prompt": await preparer.decode(body.tokens)})

    # Added last = outermost: the host, then the key are checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = OPEN_PATHS - {"/metrics"} if guard_metrics else OPEN_PATHS
        # A proxy that keeps the prefix sends /prefix/health; one that strips it, /health.
        open_paths |= {root_path + path for path in open_paths}
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(AllowedHostsMiddleware, hosts=allowed_hosts)
    if root_path:
        app.add_middleware(RootPathMiddleware, root_path=root_path)
    return app


async def invocation_body(request: Request) -> ChatCompletionRequest | CompletionRequest:
    """A SageMaker ``/invocations`` body as the request it is, by its shape as vLLM routes it:
    ``messages`` makes a chat completion, ``prompt`` a completion; anything else is a 400."""
    try:
        raw = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequestError(f"the body is not valid JSON: {exc}", None) from exc
    if isinstance(raw, dict) and "messages" in raw:
        kind: type[ChatCompletionRequest | CompletionRequest] = ChatCompletionRequest
    elif isinstance(raw, dict) and "prompt" in raw:
        kind = CompletionRequest
    else:
        raise InvalidRequestError(
            "an /invocations body is a chat completion request (with 'messages') or a "
            "completion request (with 'prompt')",
            None,
        )
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False), body=raw) from exc


def default_model_name(model: str | None) -> str:
    """The name clients use for ``model``: the packaged model's name, else the model string."""
    return model or DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the HTTP server runs (the ``serve`` flags that are not the app's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    read_timeout: float = DEFAULT_READ_TIMEOUT
    shutdown_timeout: float = 30.0
    exit_on_engine_death: bool = True


class PlatformServer(uvicorn.Server):
    """uvicorn's server plus: at shutdown, requests still running after ``shutdown_timeout``
    end cleanly (``Drain``); with ``exit_on_engine_death``, it stops once the engine stopped
    serving and ``engine_died`` says so."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, settings: ServerSettings) -> None:
        super().__init__(config)
        self.ctx: ServerContext = app.state.ctx
        self.settings = settings
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if self.settings.exit_on_engine_death and not self.should_exit:
            engine = self.ctx.engine
            if not engine.is_running:
                logger.error("the engine stopped serving (%s); exiting", engine.error)
                self.engine_died = self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.ctx.drain.start(self.settings.shutdown_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            self.ctx.preparer.shutdown()


def make_server(app: FastAPI, settings: ServerSettings) -> PlatformServer:
    """The uvicorn server for ``app`` (from ``build_app``): what ``serve`` and the tests run."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        http=functools.partial(ReadTimeoutH11Protocol, read_timeout=settings.read_timeout),
        timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE_SECONDS,
    )
    return PlatformServer(config, app, settings)


def api_key_from(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$PLATFORM_CORE_API_KEY``, else ``None``; an empty key is an error
    (it used to mean no auth, silently)."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise ConfigError(f"{source} is empty; give a non-empty key, or leave it unset for no auth")
    return key


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, then drain and stop (exit status 0), or
    until the engine dies (``ENGINE_DEATH_EXIT_STATUS`` with --exit-on-engine-death).
    Several API servers or engine cores on other hosts are ``multi_server.run_supervised``'s."""
    from platform_core.entrypoints.engine_args import engine_config_from_args

    api_key = api_key_from(args)  # before loading anything: a bad key fails fast
    config = engine_config_from_args(args)
    models = models_from_args(args, config)  # a bad adapter fails before the engine starts
    engine = start_engine(config, args.engine_mode)
    return serve_engine(engine, args, api_key, models)


def models_from_args(args: argparse.Namespace, config: EngineConfig) -> ServedModels:
    """The models ``serve`` serves: the base model as --served-model-name (default:
    ``default_model_name``) and ``--lora-modules``, checked now (``ConfigError`` for a bad
    one); with several API servers, no adapters are loaded or unloaded at run time."""
    name = args.served_model_name or default_model_name(config.model.model)
    return served_models(config, name, args.lora_modules, args.api_server_count == 1)


def serve_engine(
    engine: SubmitFront,
    args: argparse.Namespace,
    api_key: str | None,
    models: ServedModels,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve ``engine`` and ``models`` (``models_from_args``) with the ``serve`` flags in
    ``args`` (on ``sockets`` when given, else binding --host/--port) until stopped; shut the
    engine down; the exit status."""
    from platform_core.entrypoints.engine_args import engine_config_from_args

    server = None
    try:
        parsing = engine_config_from_args(args).structured_outputs
        app = build_app(
            engine,
            models.base_name,
            api_key=api_key,
            max_body_bytes=args.max_body_bytes,
            guard_metrics=args.guard_metrics,
            allowed_hosts=tuple(args.allowed_hosts or default_allowed_hosts(args.host)),
            limits=RequestLimits(
                args.max_prompts_per_request,
                args.max_choices_per_request,
                args.max_token_id_list_length,
                args.max_stream_buffer_tokens,
            ),
            tokenizer_threads=args.tokenizer_threads,
            strict_request_fields=args.strict_request_fields,
            enable_force_include_usage=args.enable_force_include_usage,
            trust_request_chat_template=args.trust_request_chat_template,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            root_path=args.root_path,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            reasoning_parser=parsing.reasoning_parser,
            tool_call_parser=parsing.tool_call_parser,
            enable_auto_tool_choice=parsing.enable_auto_tool_choice,
            models=models,
        )
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            log_level=getattr(args, "log_level", "info"),
            read_timeout=args.read_timeout,
            shutdown_timeout=args.shutdown_timeout,
            exit_on_engine_death=args.exit_on_engine_death,
        )
        server = make_server(app, settings)
        # uvicorn drains requests on SIGTERM, then raises the signal again: make that a
        # KeyboardInterrupt (as for SIGINT) so the engine below is stopped, not killed.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        logger.info("serving %r on http://%s:%d", models.base_name, args.host, args.port)
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return ENGINE_DEATH_EXIT_STATUS if server is not None and server.engine_died else 0
