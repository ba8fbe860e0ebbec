"""Finding where a bracketed expression ends while its text is still arriving."""

from __future__ import annotations


class BracketEnd:
    """Finds where the bracketed expression starting at ``text[0]`` ends: where its brackets
    (any of ``()[]{}``) balance outside quoted strings. Strings open with one of ``quotes`` and
    know backslash escapes; whether the expression is well formed is the parser's to check.
    Each character is scanned once however the text arrives."""

    def __init__(self, quotes: str) -> None:
        self._quotes = quotes
        self._scanned = 0
        self._depth = 0
        self._quote = ""  # the quote of the string being scanned, if any
        self._escaped = False

    def find(self, text: str) -> int | None:
        """The index just past the expression in ``text`` (which only grows between calls),
        or None while it is unfinished."""
        for i in range(self._scanned, len(text)):
            char = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
            elif char in self._quotes:
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._scanned = len(text)
        return None
