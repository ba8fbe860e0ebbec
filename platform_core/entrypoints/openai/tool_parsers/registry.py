"""Tool-call parsers by name (``--tool-call-parser``), extensible through entry points."""

from __future__ import annotations

from collections.abc import Callable

from platform_core.entrypoints.openai.tool_parsers.base import ToolParser
from platform_core.parsing.plugin_registry import ParserRegistry

#: Entry-point group of third-party tool parsers: each entry point names a ToolParser subclass,
#: registered under the entry point's name.
ENTRY_POINT_GROUP = "platform_core.tool_parsers"

_REGISTRY = ParserRegistry("tool parser", ToolParser, ENTRY_POINT_GROUP)


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator registering a ToolParser subclass under ``name``."""
    return _REGISTRY.register(name)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class named ``name``; raises UnknownParserError (a ConfigError) listing
    the known names."""
    return _REGISTRY.get(name)


def tool_parser_names() -> list[str]:
    """Every tool parser name, built-in and installed."""
    return _REGISTRY.names()
