"""Turning chat messages into prompt token ids with the model's own chat template.

transformers renders chat templates in a sandboxed Jinja environment (no file or attribute
access beyond the template's data), so a template that ships with a model cannot run code.
"""

from __future__ import annotations

from typing import Any

from platform_core.errors import InvalidRequestError

Message = dict[str, Any]

# apply_chat_template's own parameters that change what it returns rather than what the template
# sees: a template variable (``chat_template_kwargs``) may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> list[int]:
    """Prompt token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``).

    The rendered template already contains its special tokens, so encoding adds none.
    """
    text = render_chat_text(tokenizer, messages, add_generation_prompt, chat_template)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text the chat template makes of ``messages`` (special tokens included).

    ``template_kwargs`` reach the template: ``tools``, ``continue_final_message`` and any
    variable it reads (``chat_template_kwargs`` of a request); one that would change what
    ``apply_chat_template`` returns is refused.
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
    if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys()):
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as exc:  # a template error is the caller's input problem, not ours
        raise InvalidRequestError(f"the chat template failed: {exc}", "messages") from exc
