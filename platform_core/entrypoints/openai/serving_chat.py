"""``POST /v1/chat/completions``: the model's chat template, then generation, whole or streamed.

Templates are rendered by ``entrypoints.chat_template.render_chat_text`` (transformers' sandboxed
Jinja, encoded without adding special tokens again, on a worker thread) and come only from the
model directory, never from a request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from platform_core.engine.outputs import PositionLogprobs, RequestOutput
from platform_core.engine.request_stream import RequestStream
from platform_core.entrypoints.openai.deadline import RequestClock
from platform_core.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from platform_core.entrypoints.openai.serving_base import (
    DeltaTracker,
    Prompt,
    ServerContext,
    event_stream,
    new_id,
    usage,
)
from platform_core.entrypoints.openai.serving_beam import submit_or_search
from platform_core.errors import InvalidRequestError


async def chat_prompt_ids(
    ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    """Prompt token ids the model's chat template makes of ``messages`` (on a worker thread)."""
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError(
                    "only text content parts are supported", f"messages.{i}.content"
                )
            content = "\n".join(part.text for part in content if part.text is not None)
        turn = {"role": message.role, "content": content or ""}
        if message.name is not None:
            turn["name"] = message.name
        conversation.append(turn)
    return await ctx.preparer.render_chat(conversation, add_generation_prompt)


class ChatServing:
    """Handles chat completion requests against one ``ServerContext``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        """Render, tokenize, submit, then answer with JSON or an event stream."""
        ctx = self.ctx
        clock = ctx.drain.clock(body.deadline())
        ctx.check_model(body.model)
        ctx.check_limits(body, 1)
        ids = await clock.bound(chat_prompt_ids(ctx, body.messages, body.add_generation_prompt))
        prompt = Prompt(None, ids)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = ctx.engine.default_sampling.get("max_tokens")
        try:
            params = body.sampling_params(
                ctx.engine.default_sampling,
                max_tokens=max_tokens,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            )
        except InvalidRequestError as exc:
            if exc.param == "logprobs":
                exc.param = "top_logprobs"
            raise
        response_id = new_id("chatcmpl")
        stream = await submit_or_search(ctx, body, response_id, [prompt], params, clock)
        if body.stream:
            return event_stream(self._chunks(response_id, body, stream, clock))
        finals = await ctx.final_outputs(stream, request, clock)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        final = finals[0]
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(body, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        return ctx.full_response(ChatCompletionResponse, response_id, choices, finals)

    async def _chunks(
        self,
        response_id: str,
        body: ChatCompletionRequest,
        stream: RequestStream,
        clock: RequestClock,
    ) -> AsyncIterator[ChatCompletionChunk]:
        ctx = self.ctx
        tracker = DeltaTracker()
        final: RequestOutput | None = None
        async for output in ctx.tracked(stream, clock):
            final = output
            choices = [
                ChatStreamChoice(
                    index=d.index,
                    delta=DeltaMessage(role="assistant" if d.first else None, content=d.text),
                    logprobs=self._logprobs(
                        body,
                        d.completion.token_ids[d.start :],
                        (d.completion.logprobs or [])[d.start :],
                    ),
                    finish_reason=d.completion.finish_reason,
                    stop_reason=d.completion.stop_reason,
                )
                for d in tracker.deltas(0, output)
            ]
            if choices:
                yield ChatCompletionChunk(
                    id=response_id, created=ctx.created, model=ctx.model_name, choices=choices
                )
        if body.include_usage and final is not None:
            yield ChatCompletionChunk(
                id=response_id,
                created=ctx.created,
                model=ctx.model_name,
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
        content = []
        for token_id, position in zip(token_ids, positions or []):
            ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)[:top_n]
            top = [self._entry(t, lp.logprob, lp.decoded_token) for t, lp in ranked]
            chosen = position[token_id]
            entry = self._entry(token_id, chosen.logprob, chosen.decoded_token)
            content.append(TokenLogprob(**entry.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float, text: str | None) -> TopLogprob:
        if text is None:
            text = f"token_id:{token_id}"
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
