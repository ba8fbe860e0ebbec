"""The reasoning parser: separates a model's thinking from its answer, in text and in tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from platform_core.parsing.resumable import ResumableStream
from platform_core.reasoning.think_tags import ThinkTagSplitter


@dataclass(frozen=True)
class ReasoningDelta:
    """What of a streamed piece of output is reasoning and what is content (None: nothing)."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Splits the output of a model that thinks in ``<think>...</think>`` (see
    :mod:`platform_core.reasoning.think_tags` for the whitespace conventions).

    ``tokenizer`` is a Hugging Face tokenizer (``encode``, ``decode``, ``convert_tokens_to_ids``,
    ``get_vocab``). The token-level methods are stateless. Streaming keeps per-stream state to
    cost O(delta) per call: use one instance per stream (any instance gives the right answer,
    an instance shared by interleaved streams only does more work).
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    #: Whether output without an opening tag starts in reasoning (the chat template opened it).
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._stream = ResumableStream(self._splitter)

    def _splitter(self) -> ThinkTagSplitter:
        return ThinkTagSplitter(self.start_tag, self.end_tag, self.starts_in_reasoning)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; None where there is none."""
        splitter = self._splitter()
        reasoning, content = splitter.feed(text)
        held_reasoning, held_content = splitter.finish()
        return reasoning + held_reasoning or None, content + held_content or None

    def extract_reasoning_streaming(
        self, previous_text: str, delta_text: str
    ) -> ReasoningDelta | None:
        """The split of ``delta_text``, which follows ``previous_text``; None if nothing can be
        sent yet (a tail that may be part of a tag is held back until it is decided)."""
        return _delta(self._stream.feed(previous_text, delta_text))

    def finish(self, previous_text: str) -> ReasoningDelta | None:
        """The held-back tail once the stream whose whole text is ``previous_text`` has ended:
        an unfinished tag is sent as text of the channel it was in (reasoning inside an unclosed
        block). Concatenating every delta of a stream then gives :meth:`extract_reasoning`."""
        return _delta(self._stream.finish(previous_text))

    @cached_property
    def end_token_ids(self) -> tuple[int, ...]:
        """The tokens of the closing tag: its id when the vocabulary has it as one token, else
        its encoding (a model may tokenize it differently in context; then it goes unseen)."""
        if self.end_tag in self.tokenizer.get_vocab():
            return (self.tokenizer.convert_tokens_to_ids(self.end_tag),)
        return tuple(self.tokenizer.encode(self.end_tag, add_special_tokens=False))

    def content_start(self, output_token_ids: Sequence[int], searched: int = 0) -> int | None:
        """The index in ``output_token_ids`` where content begins (just after the first closing
        tag), or None while still reasoning. ``searched``: how many leading tokens an earlier
        call found no closing tag in; the search resumes there, so polling a growing output
        with ``searched=len(previous output)`` costs O(new tokens)."""
        end = self.end_token_ids
        position = _find(output_token_ids, end, max(0, searched - len(end) + 1))
        return None if position is None else position + len(end)

    def reasoning_ended_in_prompt(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the chat template already closed the reasoning block: the prompt ends with
        the closing tag and whitespace (Qwen3 with ``enable_thinking=False``), so the whole
        output is content. A closing tag of an earlier turn does not count."""
        end = self.end_token_ids
        last = None
        position = _find(prompt_token_ids, end, 0)
        while position is not None:
            last = position
            position = _find(prompt_token_ids, end, position + 1)
        if last is None:
            return False
        return not self.tokenizer.decode(list(prompt_token_ids[last + len(end) :])).strip()


def _find(ids: Sequence[int], pattern: tuple[int, ...], start: int) -> int | None:
    """The first index >= ``start`` where ``pattern`` occurs in ``ids``."""
    last = len(ids) - len(pattern)
    while start <= last:
        try:
            start = ids.index(pattern[0], start, last + 1)
        except ValueError:
            return None
        if all(ids[start + k] == pattern[k] for k in range(1, len(pattern))):
            return start
        start += 1
    return None


def _delta(split: tuple[str, str]) -> ReasoningDelta | None:
    reasoning, content = split
    if not reasoning and not content:
        return None
    return ReasoningDelta(reasoning or None, content or None)
