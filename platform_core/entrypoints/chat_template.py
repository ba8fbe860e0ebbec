"""Turning chat messages into prompt token ids with the model's own chat template.

transformers renders chat templates in a sandboxed Jinja environment (no file or attribute
access beyond the template's data), so a template that ships with a model cannot run code.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

from platform_core.errors import InvalidRequestError

Message = dict[str, Any]


@cache
def _reserved_names(tokenizer_type: type) -> frozenset[str]:
    """Names ``apply_chat_template`` takes itself: template variables may not reuse them."""
    parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return frozenset(n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD)


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **options: Any,
) -> list[int]:
    """Prompt token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``); ``options``
    are ``render_chat_text``'s keywords.

    The rendered template already contains its special tokens, so encoding adds none.
    """
    text = render_chat_text(tokenizer, messages, add_generation_prompt, chat_template, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    *,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text the chat template makes of ``messages`` (special tokens included).

    ``continue_final_message`` leaves the last message open for the model to go on with;
    ``template_kwargs`` are extra variables for the template (``enable_thinking``...);
    ``tools`` (OpenAI tool definitions) are the template's ``tools``.
    """
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer; this model has none", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template; use completions, or pass a chat template",
            "messages",
        )
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequestError(
            "messages must be a non-empty list of {role, content} objects", "messages"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    template_kwargs = template_kwargs or {}
    reserved = sorted(_reserved_names(type(tokenizer)) & template_kwargs.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {reserved[0]!r}: it is a chat templating "
            "argument, not a template variable",
            f"chat_template_kwargs.{reserved[0]}",
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as exc:  # a template error is the caller's input problem, not ours
        raise InvalidRequestError(f"the chat template failed: {exc}", "messages") from exc
