"""The messages tool-call parsers produce, in the shape of OpenAI's chat API."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 random letters and digits, like OpenAI's."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ParsedCall:
    """A call a parser recognised, before it gets an id: ``arguments`` is a JSON object."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """One function call of a whole output; ``arguments`` is a JSON object string."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """The tool calls of a whole output, and the text that is not part of one."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass(frozen=True)
class DeltaToolCall:
    """A streamed piece of call ``index``: its first piece has the id and name, the
    ``arguments`` fragments of an index concatenate to the call's JSON arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str | None


@dataclass
class StreamDelta:
    """What a streamed piece of output adds: content text and pieces of tool calls."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
