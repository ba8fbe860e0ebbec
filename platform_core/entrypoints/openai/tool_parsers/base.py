"""The tool-call parser base class: one pipeline for whole outputs and for streams.

A format only provides a :class:`CallSplitter`, fed the output in pieces and answering, for
each piece, the content text and the complete calls it finished. The base class numbers the
calls, gives them ids, tidies the whitespace around them, and turns the pieces into OpenAI's
streaming shape. A call is streamed once it is complete, as one delta with index, id, name and
the whole arguments. Whole outputs and streams go through the same splitter, so they agree as
long as the splitter gives the same pieces however the text is cut (its contract).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

from platform_core.entrypoints.openai.tool_parsers.messages import (
    DeltaToolCall,
    ExtractedToolCalls,
    ParsedCall,
    StreamDelta,
    ToolCall,
    new_call_id,
)
from platform_core.parsing.resumable import ResumableStream

Piece = str | ParsedCall


class CallSplitter(Protocol):
    """A format's incremental parser: content text (str) and complete calls, in order. It must
    give the same pieces (up to how content text is cut) however the output is split, and
    never raise on model output: text that does not parse as a call is content."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


@dataclass
class _Step:
    """The content text and the calls (numbered from ``first_index``) of one piece of output."""

    content: str
    calls: list[ToolCall]
    first_index: int

    def delta(self) -> StreamDelta | None:
        if not self.content and not self.calls:
            return None
        calls = [
            DeltaToolCall(self.first_index + i, call.id, call.name, call.arguments)
            for i, call in enumerate(self.calls)
        ]
        return StreamDelta(self.content or None, calls)


class _CallStream:
    """Gives a splitter's calls their index and id, and drops the whitespace next to a call
    unless it separates two pieces of content (an output without calls keeps its text as it
    is). Trailing whitespace is held until the next piece shows which case it is."""

    def __init__(self, splitter: CallSplitter) -> None:
        self._splitter = splitter
        self._calls = 0
        self._trailing_space = ""
        self._sent_content = False

    def feed(self, text: str) -> _Step:
        return self._step(self._splitter.feed(text))

    def finish(self) -> _Step:
        step = self._step(self._splitter.finish())
        if not self._calls:
            step.content += self._trailing_space
        self._trailing_space = ""
        return step

    def _step(self, pieces: list[Piece]) -> _Step:
        step = _Step("", [], self._calls)
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                step.calls.append(ToolCall(new_call_id(), piece.name, piece.arguments))
                self._calls += 1
                self._trailing_space = ""
                continue
            if self._calls and not self._sent_content:
                piece = piece.lstrip()
            text = self._trailing_space + piece
            body = text.rstrip()
            self._trailing_space = text[len(body) :]
            step.content += body
            self._sent_content = self._sent_content or bool(body)
        return step


class ToolParser(abc.ABC):
    """Extracts tool calls from a model's output. ``tokenizer`` (a Hugging Face tokenizer) is
    kept for formats that need it; the built-in ones do not. Streaming keeps per-stream state
    to cost O(delta) per call: use one instance per stream."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._stream = ResumableStream(lambda: _CallStream(self.new_splitter()))

    @abc.abstractmethod
    def new_splitter(self) -> CallSplitter:
        """A fresh incremental parser of this format, for one output."""

    def extract_tool_calls(self, text: str, tools: list[dict] | None = None) -> ExtractedToolCalls:
        """The calls and the content of a whole output (``tools``: the request's tools, for
        formats that need them). Output that is not a call is content; this never raises."""
        stream = _CallStream(self.new_splitter())
        steps = [stream.feed(text), stream.finish()]
        calls = [call for step in steps for call in step.calls]
        content = "".join(step.content for step in steps) or None
        return ExtractedToolCalls(bool(calls), calls, content)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str
    ) -> StreamDelta | None:
        """What ``delta_text`` (``current_text`` = ``previous_text`` + ``delta_text``) adds;
        None if nothing can be sent yet (a possible call is held until it is complete)."""
        return self._stream.feed(previous_text, delta_text).delta()

    def finish(self, current_text: str) -> StreamDelta | None:
        """The rest once the stream whose whole text is ``current_text`` has ended: a call left
        incomplete is sent as content (or as a call, when what came parses as one)."""
        return self._stream.finish(current_text).delta()
