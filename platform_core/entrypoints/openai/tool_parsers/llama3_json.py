"""Llama 3.1 / 3.2 JSON calls: ``<|python_tag|>`` (optional), then objects
``{"name": ..., "parameters": {...}}`` separated by ``;`` or whitespace."""

from __future__ import annotations

import enum

from platform_core.entrypoints.openai.tool_parsers.base import Piece, ToolParser
from platform_core.entrypoints.openai.tool_parsers.brackets import BracketEnd
from platform_core.entrypoints.openai.tool_parsers.json_calls import call_from_json
from platform_core.entrypoints.openai.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = "; \t\r\n"


class _Phase(enum.Enum):
    OPENING = enum.auto()  # whitespace and maybe part of the python tag so far
    CALLS = enum.auto()
    CONTENT = enum.auto()


class Llama3JsonSplitter:
    """Output that opens with the python tag or ``{`` is read as calls, one object after the
    other; from the first thing that is not a call object on, the rest is content (with the
    python tag dropped). Other output is content as written."""

    def __init__(self) -> None:
        self._phase = _Phase.OPENING
        self._held = ""
        self._object_end = BracketEnd(quotes='"')

    def feed(self, text: str) -> list[Piece]:
        """Content, and the calls whose object ``text`` completes."""
        text, self._held = self._held + text, ""
        if self._phase is _Phase.OPENING:
            text = self._open(text)
        pieces: list[Piece] = []
        while self._phase is _Phase.CALLS:
            text = text.lstrip(_SEPARATORS)
            if not text:
                return pieces
            if not text.startswith("{"):
                self._phase = _Phase.CONTENT
                break
            end = self._object_end.find(text)
            if end is None:
                self._held = text
                return pieces
            call = call_from_json(text[:end])
            if call is None:
                self._phase = _Phase.CONTENT
                break
            pieces.append(call)
            text, self._object_end = text[end:], BracketEnd(quotes='"')
        if self._phase is _Phase.CONTENT:
            pieces.append(text)
        return pieces

    def finish(self) -> list[Piece]:
        """Held text (an unfinished object, or an unfinished python tag) as content."""
        held, self._held = self._held, ""
        return [held]

    def _open(self, text: str) -> str:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            self._phase = _Phase.CALLS
            return stripped[len(PYTHON_TAG) :]
        if PYTHON_TAG.startswith(stripped):
            self._held = text
            return ""
        self._phase = _Phase.CALLS if stripped.startswith("{") else _Phase.CONTENT
        return text


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls (``arguments`` accepted for ``parameters``)."""

    def new_splitter(self) -> Llama3JsonSplitter:
        return Llama3JsonSplitter()
