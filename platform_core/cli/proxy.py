"""The ``proxy`` subcommand of ``platform-core``: one OpenAI-compatible front for prefill and
decode instances (disaggregated serving)."""

from __future__ import annotations

import argparse
from typing import Any

from platform_core.entrypoints.proxy.config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HEALTH_TIMEOUT,
    ROUTING_POLICIES,
    ProxyConfig,
)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from platform_core.entrypoints.proxy.app import run_proxy

    config = ProxyConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        routing=args.routing,
        api_key=args.api_key,
        connect_timeout=args.connect_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
    )
    return run_proxy(config, args.host, args.port, getattr(args, "log_level", "info"))


def add_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``proxy`` to a ``platform-core`` subparsers object; return its parser."""
    proxy = subparsers.add_parser(
        "proxy",
        help="serve an OpenAI-compatible front that has prefill instances compute prompts and "
        "decode instances generate (prefill/decode disaggregation)",
    )
    proxy.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="base URLs of the prefill instances (serve --kv-transfer-config with kv_role "
        "kv_producer), e.g. http://10.0.0.1:8100",
    )
    proxy.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="base URLs of the decode instances (kv_role kv_consumer)",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    proxy.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=ROUTING_POLICIES[0],
        help="how a request's instance of each side is picked among the healthy ones: in turn, "
        "or the one with the fewest requests in flight through this proxy, ties in turn "
        f"(default: {ROUTING_POLICIES[0]})",
    )
    proxy.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: none). The client's Authorization header is passed on to the instances, so "
        "they take the same key or none",
    )
    proxy.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT,
        help="seconds to connect to an instance before it counts as down: it leaves the "
        "rotation and the request goes to another healthy instance of its side, or gets 502 "
        f"(default: {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    proxy.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL,
        help="seconds between two polls of every instance's /health: an instance that refuses "
        "the connection, or twice in a row does not answer 200, leaves the rotation until it "
        "does again "
        f"(default: {DEFAULT_HEALTH_INTERVAL:g})",
    )
    proxy.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        help="seconds each instance's /health may take before it counts as unhealthy "
        f"(default: {DEFAULT_HEALTH_TIMEOUT:g})",
    )
    proxy.set_defaults(func=_cmd_proxy)
    return proxy
