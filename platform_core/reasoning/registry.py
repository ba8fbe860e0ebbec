"""Reasoning parsers by name (``--reasoning-parser``), extensible through entry points."""

from __future__ import annotations

from collections.abc import Callable

from platform_core.parsing.plugin_registry import ParserRegistry
from platform_core.reasoning.base import ReasoningParser

#: Entry-point group of third-party reasoning parsers: each entry point names a ReasoningParser
#: subclass, registered under the entry point's name.
ENTRY_POINT_GROUP = "platform_core.reasoning_parsers"

_REGISTRY = ParserRegistry("reasoning parser", ReasoningParser, ENTRY_POINT_GROUP)


def register_reasoning_parser(
    name: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator registering a ReasoningParser subclass under ``name``."""
    return _REGISTRY.register(name)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class named ``name``; raises UnknownParserError (a ConfigError)
    listing the known names."""
    return _REGISTRY.get(name)


def reasoning_parser_names() -> list[str]:
    """Every reasoning parser name, built-in and installed."""
    return _REGISTRY.names()
