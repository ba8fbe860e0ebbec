"""Pythonic calls: ``[get_weather(city='Paris'), other(x=1)]``, a list of calls with literal
keyword arguments, read with :mod:`ast` (never evaluated)."""

from __future__ import annotations

import ast
import enum

from platform_core.entrypoints.openai.tool_parsers.base import Piece, ToolParser
from platform_core.entrypoints.openai.tool_parsers.brackets import BracketEnd
from platform_core.entrypoints.openai.tool_parsers.json_calls import dump_arguments
from platform_core.entrypoints.openai.tool_parsers.messages import ParsedCall
from platform_core.entrypoints.openai.tool_parsers.registry import register_tool_parser


class _Phase(enum.Enum):
    OPENING = enum.auto()  # only whitespace so far
    LIST = enum.auto()
    CONTENT = enum.auto()


def _expression(source: str) -> ast.expr | None:
    """The Python expression ``source`` is, parsed (not run), or None."""
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None


def _calls(tree: ast.expr) -> list[ParsedCall] | None:
    """The calls of a list of calls ``name(keyword=literal, ...)``, or None when ``tree`` is
    anything else (positional or non-literal arguments included)."""
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        call = _call(node)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(node: ast.expr) -> ParsedCall | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, RecursionError):
            return None
    arguments_json = dump_arguments(arguments)
    return None if arguments_json is None else ParsedCall(node.func.id, arguments_json)


class PythonicSplitter:
    """Output opening with ``[`` (after whitespace) is held until its brackets balance; if that
    text is a list of calls they are the calls, else it is content. The rest of the output, and
    any output not opening with ``[``, is content as written."""

    def __init__(self) -> None:
        self._phase = _Phase.OPENING
        self._held = ""
        self._list_end = BracketEnd(quotes="'\"")

    def feed(self, text: str) -> list[Piece]:
        """Content, or the calls of the list that ``text`` closes."""
        text, self._held = self._held + text, ""
        pieces: list[Piece] = []
        if self._phase is _Phase.OPENING:
            body = text.lstrip()
            if not body:
                self._held = text
                return []
            self._phase = _Phase.LIST if body.startswith("[") else _Phase.CONTENT
            if self._phase is _Phase.LIST:
                pieces.append(text[: len(text) - len(body)])
                text = body
        if self._phase is _Phase.LIST:
            end = self._list_end.find(text)
            if end is None:
                self._held = text
                return pieces
            self._phase = _Phase.CONTENT
            tree = _expression(text[:end])
            calls = None if tree is None else _calls(tree)
            pieces.extend(calls or [text[:end]])
            text = text[end:]
        pieces.append(text)
        return pieces

    def finish(self) -> list[Piece]:
        """An unclosed list (or leading whitespace) as content."""
        held, self._held = self._held, ""
        return [held]


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 style pythonic tool calls."""

    def new_splitter(self) -> PythonicSplitter:
        return PythonicSplitter()
