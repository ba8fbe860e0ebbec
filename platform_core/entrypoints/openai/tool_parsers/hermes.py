"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

from __future__ import annotations

from platform_core.entrypoints.openai.tool_parsers.base import Piece, ToolParser
from platform_core.entrypoints.openai.tool_parsers.json_calls import call_from_json
from platform_core.entrypoints.openai.tool_parsers.registry import register_tool_parser
from platform_core.reasoning.think_tags import partial_suffix

START = "<tool_call>"
END = "</tool_call>"


class HermesSplitter:
    """Text outside blocks is content; a block whose JSON is a call is a call, any other block
    stays content as written. A block left open at the end is a call if its JSON is one (the
    closing tag may have been a stop string)."""

    def __init__(self) -> None:
        self._held = ""
        self._in_block = False
        self._searched = 0  # how much of an open block was searched for END

    def feed(self, text: str) -> list[Piece]:
        """Content and the calls of the blocks closed by ``text``."""
        text, self._held = self._held + text, ""
        pieces: list[Piece] = []
        while text:
            if self._in_block:
                end = text.find(END, max(0, self._searched - len(END) + 1))
                if end < 0:
                    self._held, self._searched = text, len(text)
                    break
                pieces.append(self._block(text[:end], closed=True))
                text, self._in_block = text[end + len(END) :], False
                continue
            start = text.find(START)
            if start < 0:
                keep = partial_suffix(text, START)
                pieces.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            pieces.append(text[:start])
            text, self._in_block, self._searched = text[start + len(START) :], True, 0
        return pieces

    def finish(self) -> list[Piece]:
        """An open block, or held text that may have begun one."""
        held, self._held = self._held, ""
        return [self._block(held, closed=False) if self._in_block else held]

    @staticmethod
    def _block(body: str, closed: bool) -> Piece:
        call = call_from_json(body)
        if call is not None:
            return call
        return START + body + (END if closed else "")


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3 tool calls in ``<tool_call>`` blocks."""

    def new_splitter(self) -> HermesSplitter:
        return HermesSplitter()
