"""``POST /v1/chat/completions``: the model's chat template, then generation, whole or streamed.

Templates are rendered by ``entrypoints.chat_template.render_chat_text`` (transformers' sandboxed
Jinja, encoded without adding special tokens again, on a worker thread) and come from the model
directory; a request's own ``chat_template`` only with ``--trust-request-chat-template`` (a
template is code: a sandboxed one still can loop for long).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from platform_core.engine.outputs import PositionLogprobs, RequestOutput
from platform_core.engine.request_stream import RequestStream
from platform_core.entrypoints.openai.chat_parsing import (
    ChatParsers,
    ReplyFormat,
    ReplyParser,
    ReplyParts,
    tool_call_items,
    whole_tool_calls,
)
from platform_core.entrypoints.openai.deadline import RequestClock
from platform_core.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from platform_core.entrypoints.openai.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from platform_core.entrypoints.openai.responses import (
    DeltaTracker,
    event_stream,
    format_prompt_logprobs,
    kv_transfer_params,
    usage,
    with_ignored_header,
)
from platform_core.entrypoints.openai.serving_base import Prompt, ServerContext, new_id
from platform_core.entrypoints.openai.serving_beam import submit_or_search
from platform_core.entrypoints.openai.tool_protocol import MessageToolCall
from platform_core.errors import InvalidRequestError


async def chat_prompt_ids(
    ctx: ServerContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    keep_last: int | None = None,
    **options: Any,
) -> list[int]:
    """Prompt token ids the chat template makes of ``messages`` (on a worker thread); ``options``
    are ``render_chat_text``'s (``chat_template``, ``continue_final_message``...)."""
    conversation = [_template_turn(i, message) for i, message in enumerate(messages)]
    return await ctx.preparer.render_chat(
        conversation, add_generation_prompt, keep_last=keep_last, **options
    )


def _template_turn(i: int, message: ChatMessage) -> dict[str, Any]:
    """Message ``i`` as the chat template reads it: text content, and an assistant turn's
    tool calls with their arguments as a dict (what templates iterate over) when they are a
    JSON object."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise InvalidRequestError(
                "only text content parts are supported", f"messages.{i}.content"
            )
        content = "\n".join(part.text for part in content if part.text is not None)
    turn: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        turn["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    return turn


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        arguments = call.function.arguments  # not an object: the template gets the text
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def _echo_text(body: ChatCompletionRequest) -> str:
    """What ``echo`` prepends: the last message's text when it is the assistant's."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content if part.text is not None)


def _content(reply: ReplyFormat, echo: str, parts: ReplyParts) -> str | None:
    """The content of a reply (or a piece of it) after ``echo``: null when there is none and
    the reply is parsed (it may be all reasoning or calls), else the text as it is."""
    content = echo + parts.content
    return content or None if reply.parsing else content


class ChatServing:
    """Handles chat completion requests against one ``ServerContext``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.parsers = ChatParsers.from_options(ctx.options)

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        """Render, tokenize, submit, then answer with JSON or an event stream."""
        ctx = self.ctx
        created = int(time.time())
        clock = ctx.drain.clock(body.deadline())
        ignored = ctx.check_request(body, "chat/completions")
        lora = ctx.check_model(body.model)
        ctx.check_limits(body, 1)
        if body.chat_template is not None and not ctx.options.trust_request_chat_template:
            raise InvalidRequestError(
                "this server does not take chat templates from requests (start it with "
                "--trust-request-chat-template to allow them)",
                "chat_template",
            )
        if body.top_logprobs not in (None, 0) and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        top_logprobs = ctx.logprob_count(body.top_logprobs, "top_logprobs")
        prompt_logprobs = ctx.logprob_count(body.prompt_logprobs, "prompt_logprobs")
        ids = await clock.bound(
            chat_prompt_ids(
                ctx,
                body.messages,
                body.add_generation_prompt,
                ctx.keep_last(body),
                chat_template=body.chat_template,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                tools=body.tool_dicts() or None,
            )
        )
        reply = self.parsers.reply_format(body, ids, ctx.engine.tokenizer)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = ctx.engine.default_sampling.get("max_tokens")
        params = body.sampling_params(
            ctx.engine.default_sampling,
            max_tokens=max_tokens,
            logprobs=(top_logprobs or 0) if body.logprobs else None,
            prompt_logprobs=prompt_logprobs,
            **({} if reply.constraint is None else {"structured_outputs": reply.constraint}),
        )
        response_id = new_id("chatcmpl")
        prompts = [Prompt(None, ids)]
        stream = await submit_or_search(ctx, body, response_id, prompts, params, clock, lora)
        model = ctx.response_model(lora)
        echo = _echo_text(body)
        if body.stream:
            chunks = self._chunks(response_id, created, model, body, echo, reply, stream, clock)
            return with_ignored_header(event_stream(chunks), ignored)
        finals = await ctx.final_outputs(stream, request, clock)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        final = finals[0]
        choices = []
        for c in final.outputs:
            parser = reply.new_parser(ctx.engine.tokenizer)
            parts = parser.parse(c.text)
            message = AssistantMessage(
                content=_content(reply, echo, parts),
                reasoning_content=parts.reasoning or None,
                tool_calls=whole_tool_calls(parts.tool_calls),
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(body, c.token_ids, c.logprobs),
                    finish_reason=parser.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if body.return_token_ids else None,
                )
            )
        response = ctx.full_response(
            ChatCompletionResponse,
            response_id,
            created,
            model,
            choices,
            usage(finals),
            prompt_token_ids=final.prompt_token_ids if body.return_token_ids else None,
            prompt_logprobs=format_prompt_logprobs(final.prompt_logprobs)
            if prompt_logprobs is not None
            else None,
            kv_transfer_params=kv_transfer_params(finals),
        )
        return with_ignored_header(response, ignored)

    async def _chunks(
        self,
        response_id: str,
        created: int,
        model: str,
        body: ChatCompletionRequest,
        echo: str,
        reply: ReplyFormat,
        stream: RequestStream,
        clock: RequestClock,
    ) -> AsyncIterator[ChatCompletionChunk]:
        """One chunk per choice delta (what OpenAI's and vLLM's clients read)."""
        ctx = self.ctx
        tracker = DeltaTracker()
        parsers: dict[int, ReplyParser] = {}
        final: RequestOutput | None = None
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
        async for output in ctx.tracked(stream, clock):
            final = output
            for d in tracker.deltas(0, output):
                ids = d.completion.token_ids[d.start :]
                parser = parsers.get(d.index)
                if parser is None:
                    parser = parsers[d.index] = reply.new_parser(ctx.engine.tokenizer)
                parts = parser.feed(d.text)
                if d.completion.finished:
                    parts = parts.add(parser.finish())
                choice = ChatStreamChoice(
                    index=d.index,
                    delta=DeltaMessage(
                        role="assistant" if d.first else None,
                        content=_content(reply, echo if d.first else "", parts),
                        reasoning_content=parts.reasoning or None,
                        tool_calls=tool_call_items(parts.tool_calls),
                    ),
                    logprobs=self._logprobs(body, ids, (d.completion.logprobs or [])[d.start :]),
                    finish_reason=parser.finish_reason(d.completion.finish_reason),
                    stop_reason=d.completion.stop_reason,
                    token_ids=ids if body.return_token_ids else None,
                )
                first_ids = body.return_token_ids and d.first
                yield ChatCompletionChunk(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=usage([output]) if continuous else None,
                    prompt_token_ids=output.prompt_token_ids if first_ids else None,
                    kv_transfer_params=d.kv_transfer_params,
                )
        if ctx.include_usage(body) and final is not None:
            yield ChatCompletionChunk(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage([final]),
            )

    def _logprobs(
        self,
        body: ChatCompletionRequest,
        token_ids: list[int],
        positions: list[PositionLogprobs] | None,
    ) -> ChatLogprobs | None:
        if not body.logprobs:
            return None
        top_n = body.top_logprobs or 0
        as_ids = self.ctx.tokens_as_ids(body)
        content = []
        for token_id, position in zip(token_ids, positions or []):
            ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)[:top_n]
            top = [self._entry(t, lp.logprob, lp.decoded_token, as_ids) for t, lp in ranked]
            chosen = position[token_id]
            entry = self._entry(token_id, chosen.logprob, chosen.decoded_token, as_ids)
            content.append(TokenLogprob(**entry.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float, text: str | None, as_id: bool) -> TopLogprob:
        if text is None or as_id:
            text = f"token_id:{token_id}"
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
