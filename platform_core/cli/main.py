"""The ``platform-core`` command: generate, backends (more subcommands register here)."""

from __future__ import annotations

import argparse
import logging
import sys

from platform_core.cli.bench import add_bench_parser
from platform_core.cli.chat import add_chat_parser
from platform_core.cli.conformance import add_conformance_parser
from platform_core.cli.generate import add_generate_parser
from platform_core.cli.proxy import add_proxy_parser
from platform_core.cli.serve import add_serve_parser
from platform_core.errors import PlatformCoreError


def _cmd_backends(args: argparse.Namespace) -> int:
    from platform_core.plugins.hookspecs import api_note, format_api_version
    from platform_core.plugins.manager import PluginManager

    rows = PluginManager().probe()
    if not rows:
        print("no backend plugins installed (try: pip install platform-core[cpu])")
        return 1
    header = ("name", "package", "version", "api", "available", "priority", "device", "reason")
    table = [header] + [
        (
            r.name,
            r.package,
            r.version,
            format_api_version(r.api_version),
            "yes" if r.available else "no",
            str(r.priority),
            r.device,
            r.reason,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in rows:
        if r.capabilities is not None:
            c = r.capabilities
            print(
                f"{r.name}: dtypes={list(c.dtypes)} head_sizes={list(c.head_sizes)} "
                f"block_sizes={list(c.block_sizes)} features={list(c.features)}"
            )
        for line in r.details:
            print(f"{r.name}: {line}")
        if note := api_note(r.api_version):
            print(f"{r.name}: {note}")
    return 0


def _cmd_kv_connectors(args: argparse.Namespace) -> int:
    from platform_core.kv_transfer.registry import KVConnectorRegistry
    from platform_core.plugins.hookspecs import format_api_version

    registry = KVConnectorRegistry()
    for info, _ in registry.infos():
        api = format_api_version(info.api_version)
        print(f"{info.name}  {info.package} {info.version}  api {api}  {info.description}")
    for name, reason in registry.broken.items():
        print(f"{name}: unusable: {reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="platform-core", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(commands)
    add_chat_parser(commands)
    add_conformance_parser(commands)
    add_serve_parser(commands)
    add_bench_parser(commands)
    add_proxy_parser(commands)

    backends = commands.add_parser(
        "backends", help="list installed backends and why each is usable"
    )
    backends.set_defaults(func=_cmd_backends)
    connectors = commands.add_parser(
        "kv-connectors", help="list installed KV connectors (for --kv-transfer-config)"
    )
    connectors.set_defaults(func=_cmd_kv_connectors)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``platform-core`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except PlatformCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
