"""``platform-core conformance``: run the installed conformance suite against one backend.

The suite ships in its own distribution (``platform-core-conformance``) so that vendors run it
in hardware CI without a clone of this repository; this module only forwards to it.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from platform_core_conformance import run_conformance
    except ImportError:
        print(
            "error: the conformance suite is not installed; pip install platform-core-conformance",
            file=sys.stderr,
        )
        return 2
    backend, keyword, extra = args.backend, args.keyword, []
    if args.kv_connector is not None:
        extra = ["--kv-connector", args.kv_connector]
        if args.kv_connector_config:
            extra += ["--kv-connector-config", args.kv_connector_config]
        if backend is None:  # the connector section alone, with the best backend as one peer
            from platform_core.plugins.manager import PluginManager

            backend = PluginManager().choose("auto").name
            keyword = f"kv_connector and ({keyword})" if keyword else "kv_connector"
    if backend is None:
        print("error: --backend NAME is required (or --kv-connector NAME)", file=sys.stderr)
        return 2
    return run_conformance(
        backend, report=args.report, junit=args.junit, keyword=keyword, pytest_args=extra
    )


def add_conformance_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``conformance`` subcommand on the ``platform-core`` parser's subparsers."""
    parser = subparsers.add_parser(
        "conformance",
        help="check a backend against the references (kernels, memory, collectives, end to end)",
        description="Run the platform-core conformance suite (pytest) against one backend. "
        "Exit status 0 means every selected check passed.",
    )
    parser.add_argument("--backend", help="registered name of the backend")
    parser.add_argument(
        "--kv-connector",
        metavar="NAME",
        help="the KV connector to certify: its section moves blocks between every installed "
        "backend (alone: only that section runs, with the best available backend)",
    )
    parser.add_argument(
        "--kv-connector-config",
        metavar="JSON",
        help="extra kv_transfer_config keys for that connector, e.g. its extra config",
    )
    parser.add_argument("--report", metavar="PATH", help="write the JSON report to PATH")
    parser.add_argument("--junit", metavar="PATH", help="write the JUnit XML report to PATH")
    parser.add_argument(
        "-k", dest="keyword", metavar="EXPR", help="only checks matching this pytest -k expression"
    )
    parser.set_defaults(func=_cmd_conformance)
    return parser
