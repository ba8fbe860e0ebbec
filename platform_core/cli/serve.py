"""The ``serve`` subcommand of ``platform-core``: engine flags plus HTTP flags."""

from __future__ import annotations

import argparse
from typing import Any

from platform_core.entrypoints.engine_args import add_engine_args
from platform_core.entrypoints.openai.limits import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES


def _cmd_serve(args: argparse.Namespace) -> int:
    from platform_core.entrypoints.openai.api_server import run_server

    return run_server(args)


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
        help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${API_KEY_ENV} if set)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the --model value, or the packaged model's name)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGINT/SIGTERM (default: 30)",
    )
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)
    return serve
