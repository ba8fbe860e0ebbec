"""The ``serve`` flags for several API servers and for engine cores on other hosts.

The data-parallel names follow vLLM's (``--data-parallel-size-local``, ``--data-parallel-address``,
``--data-parallel-rpc-port``, ``--headless``, ``--api-server-count``), so operators can move over.
"""

from __future__ import annotations

import argparse
from typing import Any

from platform_core.engine.core_auth import ENGINE_SECRET_ENV


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def add_scaleout_args(serve: argparse.ArgumentParser) -> None:
    """Add the multi-process and multi-host flags to the ``serve`` parser."""
    group = serve.add_argument_group("several API servers, engine cores on other hosts")
    group.add_argument(
        "--api-server-count",
        type=_at_least(1),
        default=1,
        help="HTTP server processes sharing --port (the parent binds it once and supervises "
        "them); each talks to every engine core (default: 1, in this process)",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="no HTTP server: start --data-parallel-size engine cores on this host and register "
        "them with the front at --data-parallel-address:--data-parallel-rpc-port",
    )
    group.add_argument(
        "--data-parallel-size-local",
        type=_at_least(0),
        default=None,
        help="of --data-parallel-size engine cores, how many run on this host; the front waits "
        "for the others to register from headless hosts (default: all of them)",
    )
    group.add_argument(
        "--data-parallel-address",
        default=None,
        help="the front's address: where it takes registrations (front) or where to register "
        "(headless)",
    )
    group.add_argument(
        "--data-parallel-rpc-port",
        type=_at_least(1),
        default=13345,
        help="the front's registration port (default: 13345)",
    )
    group.add_argument(
        "--engine-secret-file",
        default=None,
        help="file holding the secret fronts and engine cores prove to each other (HMAC "
        f"challenge-response; the secret never travels); default: ${ENGINE_SECRET_ENV}. "
        "Required when engine cores run on other hosts",
    )
    group.add_argument(
        "--remote-engine-timeout",
        type=float,
        default=300.0,
        help="seconds the front waits for remote engine cores to register (default: 300)",
    )
