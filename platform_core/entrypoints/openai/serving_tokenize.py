"""``POST /tokenize`` and ``GET /tokenizer_info``, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from platform_core.entrypoints.openai.protocol import TokenizeRequest
from platform_core.entrypoints.openai.responses import with_ignored_header
from platform_core.entrypoints.openai.serving_base import ServerContext
from platform_core.entrypoints.openai.serving_chat import chat_prompt_ids
from platform_core.errors import InvalidRequestError

# tokenizer init_kwargs that are paths on the server's disk, not configuration.
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> Response:
    """``{count, max_model_len, tokens, token_strs}``: ``token_strs`` only with
    ``return_token_strs`` (else null); a request's own ``chat_template`` only when the server
    trusts them (``--trust-request-chat-template``). Unknown fields as for generation requests."""
    ignored = ctx.check_fields(body, "/tokenize")
    ctx.check_model(body.model)
    if body.messages is not None:
        if body.chat_template is not None and not ctx.options.trust_request_chat_template:
            raise InvalidRequestError(
                "this server does not take chat templates from requests "
                "(start it with --trust-request-chat-template)",
                "chat_template",
            )
        tokens = await chat_prompt_ids(
            ctx,
            body.messages,
            body.add_generation_prompt,
            add_special_tokens=bool(body.add_special_tokens),
            chat_template=body.chat_template,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            tools=body.tools,
        )
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await ctx.preparer.encode(body.prompt or "", add_special)
    token_strs = None
    if body.return_token_strs:
        token_strs = ctx.preparer.tokenizer.convert_ids_to_tokens(tokens)
    answer = {
        "count": len(tokens),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }
    return with_ignored_header(JSONResponse(answer), ignored)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's configuration (its ``tokenizer_config.json`` as loaded) as JSON, plus
    ``tokenizer_class`` and the ``chat_template``; file paths are left out."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", None)
    config = {k: v for k, v in (tokenizer.init_kwargs or {}).items() if k not in _PATH_KEYS}
    info = _jsonable(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        info["chat_template"] = tokenizer.chat_template
    return info


def _jsonable(value: Any) -> Any:
    """``value`` with tokens (``AddedToken``) as their text and other objects as ``str``."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)
