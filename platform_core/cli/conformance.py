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
    return run_conformance(args.backend, report=args.report, junit=args.junit, keyword=args.keyword)


def add_conformance_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``conformance`` subcommand on the ``platform-core`` parser's subparsers."""
    parser = subparsers.add_parser(
        "conformance",
        help="check a backend against the references (kernels, memory, collectives, end to end)",
        description="Run the platform-core conformance suite (pytest) against one backend. "
        "Exit status 0 means every selected check passed.",
    )
    parser.add_argument("--backend", required=True, help="registered name of the backend")
    parser.add_argument("--report", metavar="PATH", help="write the JSON report to PATH")
    parser.add_argument("--junit", metavar="PATH", help="write the JUnit XML report to PATH")
    parser.add_argument(
        "-k", dest="keyword", metavar="EXPR", help="only checks matching this pytest -k expression"
    )
    parser.set_defaults(func=_cmd_conformance)
    return parser
