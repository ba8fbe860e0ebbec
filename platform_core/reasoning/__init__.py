"""Reasoning parsers: split a thinking model's output into reasoning and content.

Pure and engine-independent (the engine uses the token-level methods, the server the text
ones). Parsers are found by name in a registry that third parties extend through the
entry-point group ``platform_core.reasoning_parsers``.
"""

from platform_core.parsing.plugin_registry import UnknownParserError
from platform_core.reasoning.base import ReasoningDelta, ReasoningParser
from platform_core.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from platform_core.reasoning.registry import (
    ENTRY_POINT_GROUP,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "UnknownParserError",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
