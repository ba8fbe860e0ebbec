"""Splits model output into reasoning and content at ``<think>`` / ``</think>`` style tags.

The splitter is fed the output in pieces of any size and gives the same split whatever the
pieces: it holds back only a tail that could still become a tag (and a newline just before it,
which the closing convention removes). Conventions, for a model writing
``<think>\\nreasoning\\n</think>\\n\\ncontent``:

- an opening tag is recognised only at the start of the output (after whitespace); later, the
  tag text is ordinary text. Without one, the output starts in reasoning or in content, as the
  parser declares;
- one newline right after the opening tag and one right before the closing tag are dropped;
- whitespace right after the closing tag is dropped; only the first closing tag ends reasoning;
- at the end of the output, held-back text goes to the channel it was in: an unfinished tag is
  text, and an unclosed reasoning block is all reasoning.
"""

from __future__ import annotations

import enum


class _Phase(enum.Enum):
    OPENING = enum.auto()  # nothing but whitespace and maybe part of the opening tag yet
    REASONING = enum.auto()
    CONTENT = enum.auto()  # after the closing tag
    PLAIN = enum.auto()  # content, the output having no reasoning block


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ThinkTagSplitter:
    """Fed an output piece by piece, answers ``(reasoning, content)`` text for each piece."""

    def __init__(self, start_tag: str, end_tag: str, starts_in_reasoning: bool) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.OPENING
        self._held = ""
        self._reasoning_begun = False  # whether the newline after the opening tag was handled
        self._content_begun = False  # whether text after the closing tag has come

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content of ``text`` (plus what was held back before it)."""
        text, self._held = self._held + text, ""
        if self._phase is _Phase.OPENING:
            text = self._open(text)
        reasoning = ""
        if self._phase is _Phase.REASONING:
            reasoning, text = self._reason(text)
        if self._phase is _Phase.CONTENT and not self._content_begun:
            text = text.lstrip()
            self._content_begun = bool(text)
        in_content = self._phase in (_Phase.CONTENT, _Phase.PLAIN)
        return reasoning, text if in_content else ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        reasoning = self._phase is _Phase.REASONING or (
            self._phase is _Phase.OPENING and self._starts_in_reasoning
        )
        return (held, "") if reasoning else ("", held)

    def _open(self, text: str) -> str:
        """Leave the opening phase once ``text`` shows whether an opening tag starts it."""
        stripped = text.lstrip()
        if stripped.startswith(self._start_tag):
            self._phase = _Phase.REASONING
            return stripped[len(self._start_tag) :]
        if self._start_tag.startswith(stripped):
            self._held = text
        else:
            self._phase = _Phase.REASONING if self._starts_in_reasoning else _Phase.PLAIN
        return text

    def _reason(self, text: str) -> tuple[str, str]:
        """Split ``text`` in reasoning into (reasoning, text after the closing tag)."""
        if not self._reasoning_begun:
            if not text:
                return "", ""
            self._reasoning_begun = True
            text = text.removeprefix("\n")
        end = text.find(self._end_tag)
        if end >= 0:
            self._phase = _Phase.CONTENT
            return text[:end].removesuffix("\n"), text[end + len(self._end_tag) :]
        keep = partial_suffix(text, self._end_tag)
        if text[: len(text) - keep].endswith("\n"):
            keep += 1
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""
