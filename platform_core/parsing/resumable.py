"""Drives an incremental text parser from (text so far, new text) calls, without rescanning."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class TextMachine(Protocol[T_co]):
    """A parser fed a text in pieces: the result of each piece, and of the end of the text."""

    def feed(self, text: str) -> T_co: ...

    def finish(self) -> T_co: ...


class ResumableStream(Generic[T]):
    """Keeps one machine per stream and resumes it when the caller's text so far is what the
    machine has consumed, so a stream costs O(its length) in all. Otherwise (a new stream, or
    calls from two streams interleaved) it starts a fresh machine and replays the text so far:
    the answer depends only on the arguments, the state only saves work."""

    def __init__(self, new_machine: Callable[[], TextMachine[T]]) -> None:
        self._new_machine = new_machine
        self._machine: TextMachine[T] | None = None
        self._consumed = 0

    def feed(self, previous_text: str, delta_text: str) -> T:
        """The machine's result for ``delta_text``, which follows ``previous_text``."""
        machine = self._resume(previous_text)
        self._consumed += len(delta_text)
        return machine.feed(delta_text)

    def finish(self, text: str) -> T:
        """The machine's result for the end of the stream whose whole text is ``text``."""
        machine = self._resume(text)
        self._machine = None
        return machine.finish()

    def _resume(self, text: str) -> TextMachine[T]:
        if self._machine is None or self._consumed != len(text):
            self._machine = self._new_machine()
            self._machine.feed(text)
            self._consumed = len(text)
        return self._machine
