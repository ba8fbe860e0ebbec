"""Tool-call parsers: find the function calls in a model's output, whole or streamed, in the
shape of OpenAI's chat API; and the JSON schema that forces a call (``schema``).

Parsers are found by name in a registry that third parties extend through the entry-point
group ``platform_core.tool_parsers``.
"""

from platform_core.entrypoints.openai.tool_parsers.base import CallSplitter, ToolParser
from platform_core.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from platform_core.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from platform_core.entrypoints.openai.tool_parsers.messages import (
    DeltaToolCall,
    ExtractedToolCalls,
    ParsedCall,
    StreamDelta,
    ToolCall,
    new_call_id,
)
from platform_core.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from platform_core.entrypoints.openai.tool_parsers.registry import (
    ENTRY_POINT_GROUP,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from platform_core.entrypoints.openai.tool_parsers.schema import (
    forced_tool_calls_schema,
    parse_forced_tool_calls,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CallSplitter",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedCall",
    "PythonicToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolParser",
    "forced_tool_calls_schema",
    "get_tool_parser",
    "new_call_id",
    "parse_forced_tool_calls",
    "register_tool_parser",
    "tool_parser_names",
]
