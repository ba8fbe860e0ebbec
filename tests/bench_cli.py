"""Test helper: the ``bench`` command through a minimal parser, as the main CLI wires it."""

from __future__ import annotations

import argparse

from platform_core.cli.bench import add_bench_parser


def run_cli(*argv: str) -> int:
    """Run ``platform-core bench ARGV`` and return its exit code."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)
