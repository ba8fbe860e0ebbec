"""Tokenizing, chat templating and detokenizing requests on worker threads, off the event loop.

One 8 MB prompt tokenized on the event loop froze every client and ``/health`` for seconds.
Here the work runs on a small thread pool. HF fast tokenizers release the GIL in their batch
calls (``encode_batch_fast``, ``decode_batch``) but not in a single ``encode``/``decode`` through
transformers (measured: 1.4 s and 1.8 s without the event loop running once for an 8 MB text),
so fast tokenizers are called through their backend; others (pure Python) fall back to
``encode``/``decode``, which the GIL's switch interval still interleaves with the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from platform_core.entrypoints.chat_template import Message, render_chat_text
from platform_core.errors import InvalidRequestError

T = TypeVar("T")


class Preparer:
    """Runs one tokenizer's work on ``threads`` worker threads; ``None`` tokenizer: ids only."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, threads: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prepare")
        fast = getattr(tokenizer, "is_fast", False) and not getattr(
            tokenizer, "split_special_tokens", False
        )
        self._backend = tokenizer.backend_tokenizer if fast else None

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; send token ids instead of text", "prompt"
            )
        return self.tokenizer

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    async def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        param: str = "prompt",
        keep_last: int | None = None,
    ) -> list[int]:
        """Token ids of ``text`` (only the last ``keep_last`` if given); a text longer than the
        context is refused (``param``) before its ids become a Python list."""
        self._require_tokenizer()
        return await self._run(self._encode, text, add_special_tokens, param, keep_last)

    def _encode(
        self, text: str, add_special_tokens: bool, param: str, keep_last: int | None = None
    ) -> list[int]:
        if self._backend is None:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return ids if keep_last is None else ids[-keep_last:]
        (encoding,) = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        if keep_last is not None:
            encoding.truncate(keep_last, direction="left")
        # Counting is free; the list of a multi-million-token text would hold the GIL for
        # ~100 ms, and such a prompt can never fit the context anyway.
        if len(encoding) > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {len(encoding)} tokens, more than the model's "
                f"{self.max_model_len}-token context",
                param,
            )
        return encoding.ids

    async def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        """The text of ``token_ids``; ids outside the vocabulary are a 400 naming ``param``."""
        tokenizer = self._require_tokenizer()
        return await self._run(self._decode, tokenizer, token_ids, param)

    def _decode(self, tokenizer: Any, token_ids: list[int], param: str) -> str:
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise InvalidRequestError(
                f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param
            )
        # transformers may clean up spaces after decoding: only without it is the backend's
        # (GIL-releasing) decode the same.
        if self._backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return tokenizer.decode(token_ids)
        (text,) = self._backend.decode_batch([token_ids], skip_special_tokens=False)
        return text

    async def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        chat_template: str | None = None,
        keep_last: int | None = None,
        add_special_tokens: bool = False,
        **options: Any,
    ) -> list[int]:
        """Prompt ids of ``messages`` through the chat template (``render_chat_text`` with
        ``options``, encoded without adding special tokens again unless ``add_special_tokens``;
        the last ``keep_last``)."""
        return await self._run(
            functools.partial(
                self._render_chat,
                messages,
                add_generation_prompt,
                chat_template,
                keep_last,
                add_special_tokens,
                **options,
            )
        )

    def _render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        chat_template: str | None,
        keep_last: int | None,
        add_special_tokens: bool,
        **options: Any,
    ) -> list[int]:
        text = render_chat_text(
            self.tokenizer, messages, add_generation_prompt, chat_template, **options
        )
        return self._encode(text, add_special_tokens, "messages", keep_last)

    def shutdown(self) -> None:
        """Stop the worker threads (work already queued still runs)."""
        self._pool.shutdown(wait=False)
