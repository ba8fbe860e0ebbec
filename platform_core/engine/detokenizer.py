"""Incremental detokenization: text grows as tokens arrive, never splitting a character.

Decoding token by token breaks multi-byte characters and word-boundary spaces, so each step
decodes a short window ending at the newest token and emits only what it adds beyond the window's
already-emitted prefix. A trailing U+FFFD means an incomplete byte sequence: wait for more tokens.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Context from the prompt's tail makes the first output token decode with its space.
        self.tokens: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decodable text (possibly empty)."""
        self.tokens.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            self.tokens[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset, len(self.tokens) - _WINDOW)
        self.read_offset = len(self.tokens)
        self.text += new_text
        return new_text
