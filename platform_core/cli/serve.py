"""The ``serve`` subcommand of ``platform-core``: engine flags plus HTTP flags."""

from __future__ import annotations

import argparse
from typing import Any

from platform_core.cli.scaleout_args import add_scaleout_args
from platform_core.engine import ENGINE_MODES
from platform_core.entrypoints.engine_args import add_engine_args
from platform_core.entrypoints.openai.limits import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_STREAM_BUFFER_TOKENS,
    DEFAULT_MAX_TOKEN_ID_LIST_LENGTH,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_TOKENIZER_THREADS,
)
from platform_core.entrypoints.openai.lora_modules import parse_lora_module


def _hosts(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError("give at least one host name, or '*'")
    return hosts


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _cmd_serve(args: argparse.Namespace) -> int:
    from platform_core.entrypoints.openai.api_server import run_server
    from platform_core.entrypoints.openai.multi_server import needs_supervisor, run_supervised

    return run_supervised(args) if needs_supervisor(args) else run_server(args)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to a ``platform-core`` subparsers object; return its parser."""
    serve = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve.add_argument(
        "--guard-metrics",
        action="store_true",
        help="require the API key for /metrics too (by default it is open, like /health)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /ping and /metrics "
        f"(/metrics too with --guard-metrics; default: ${API_KEY_ENV} if set; an empty key is "
        "an error, not 'no auth')",
    )
    serve.add_argument(
        "--allowed-hosts",
        type=_hosts,
        default=None,
        help="comma-separated Host header names the server answers; others get 400, '*' "
        "allows any (default: localhost, 127.0.0.1, ::1 and the --host address when bound to "
        "loopback, which keeps DNS-rebinding pages out; any host when bound elsewhere, e.g. "
        "0.0.0.0, since the server's public names are unknown: list them to restrict)",
    )
    serve.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves this server under (e.g. /llm): routes "
        "answer with and without it, and links the server makes carry it (default: none)",
    )
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="write logprobs' tokens as 'token_id:N' rather than their text, for every "
        "request (as vLLM's flag; default: off, a request may still ask for it)",
    )
    serve.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's configuration and chat template, "
        "behind the API key; default: off, as in vLLM, since it shows the chat template)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the --model value, or the packaged model's name)",
    )
    serve.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve from start (needs --enable-lora): each 'name=path' (a PEFT "
        'adapter directory) or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; '
        "a request picks one by its 'model'. Each is checked before the engine starts. More "
        "can be loaded at run time with POST /v1/load_lora_adapter",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--max-prompts-per-request",
        type=_positive(int),
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="more prompts in one completions request get 400, before any is tokenized "
        f"(default: {DEFAULT_MAX_PROMPTS_PER_REQUEST}: room for batch clients, while one "
        "request cannot flood the queue)",
    )
    serve.add_argument(
        "--max-choices-per-request",
        type=_positive(int),
        default=DEFAULT_MAX_CHOICES_PER_REQUEST,
        help="n x prompts above this get 400: each is a sequence competing with other "
        f"clients' (default: {DEFAULT_MAX_CHOICES_PER_REQUEST})",
    )
    serve.add_argument(
        "--max-token-id-list-length",
        type=_positive(int),
        default=DEFAULT_MAX_TOKEN_ID_LIST_LENGTH,
        help="longer allowed_token_ids, stop_token_ids or logit_bias get 400: they cost every "
        f"step of the batch (default: {DEFAULT_MAX_TOKEN_ID_LIST_LENGTH}; prompt token ids are "
        "bounded by the context length instead)",
    )
    serve.add_argument(
        "--max-stream-buffer-tokens",
        type=_positive(int),
        default=DEFAULT_MAX_STREAM_BUFFER_TOKENS,
        help="tokens per choice generated but not yet read by the client; past it the client "
        "counts as not reading, its requests are aborted (blocks freed) and a stream ends with "
        f"an error event (default: {DEFAULT_MAX_STREAM_BUFFER_TOKENS}; a reader that keeps up "
        "lags by about one step)",
    )
    serve.add_argument(
        "--read-timeout",
        type=_positive(float),
        default=DEFAULT_READ_TIMEOUT,
        help="seconds a client has to send a whole request (headers and body) from its first "
        "byte or from connecting; slower connections are closed (default: "
        f"{DEFAULT_READ_TIMEOUT:g}: an 8 MB body at ~300 KB/s; idle kept-alive connections "
        "close after 5 s)",
    )
    serve.add_argument(
        "--tokenizer-threads",
        type=_positive(int),
        default=DEFAULT_TOKENIZER_THREADS,
        help="worker threads that tokenize, render chat templates and detokenize requests off "
        f"the event loop (default: {DEFAULT_TOKENIZER_THREADS})",
    )
    serve.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="answer 400 to a request field the server does not know (OpenAI's behaviour; by "
        "default, as in vLLM, unknown fields are ignored, logged and named in the "
        "x-platform-core-ignored-fields response header, cut at 2048 characters)",
    )
    serve.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, as if each request had asked for "
        "stream_options.include_usage (default: only when asked)",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat and /tokenize requests bring their own chat_template (default: refused "
        "with 400: a template is code, and even sandboxed it can run for long)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGINT/SIGTERM; then "
        "requests still running get 503 server_shutting_down, streams an error event and "
        "[DONE] (default: 30)",
    )
    serve.add_argument(
        "--exit-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit with status 3 within a few seconds once the engine stops serving (its loop or a "
        "worker died), so a supervisor (systemd, k8s, docker --restart) restarts the server; "
        "with --no-exit-on-engine-death it stays up answering 503 (default: on)",
    )
    serve.add_argument(
        "--engine-mode",
        choices=ENGINE_MODES,
        default="process",
        help="where the engine core runs: 'process' (its own process, talking to this server "
        "over ZMQ, so HTTP and tokenization never wait for the engine's Python; with "
        "--data-parallel-size N, N processes) or 'thread' (a thread of the server's process, "
        "sharing its GIL; the engine is inspectable in-process) (default: process)",
    )
    add_scaleout_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)
    return serve
