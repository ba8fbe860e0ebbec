"""``POST /v1/completions``: text completion of one or many prompts, whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from platform_core.engine.outputs import PositionLogprobs, RequestOutput
from platform_core.engine.request_stream import RequestStream
from platform_core.entrypoints.openai.deadline import RequestClock
from platform_core.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from platform_core.entrypoints.openai.serving_base import (
    DeltaTracker,
    Prompt,
    ServerContext,
    event_stream,
    new_id,
    prompt_index,
    usage,
)
from platform_core.entrypoints.openai.serving_beam import submit_or_search
from platform_core.errors import InvalidRequestError

# OpenAI's default for completions; chat defaults to the room left in the context.
DEFAULT_MAX_TOKENS = 16


def _num_prompts(prompt: str | list) -> int:
    """How many prompts ``prompt`` holds (a flat list of ints is one prompt of token ids)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


class CompletionServing:
    """Handles completion requests against one ``ServerContext``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        """Validate, submit every prompt, then answer with JSON or an event stream."""
        ctx = self.ctx
        clock = ctx.drain.clock(body.deadline())
        ctx.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of must be omitted or equal to n", "best_of")
        ctx.check_limits(body, _num_prompts(body.prompt))
        prompts = await clock.bound(self._prompts(body.prompt))
        echoes = None
        if body.echo:
            echoes = await clock.bound(asyncio.gather(*(self._echo_text(p) for p in prompts)))
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = ctx.engine.default_sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        params = body.sampling_params(
            ctx.engine.default_sampling,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo else None,
        )
        response_id = new_id("cmpl")
        stream = await submit_or_search(ctx, body, response_id, prompts, params, clock)
        if body.stream:
            return event_stream(self._chunks(response_id, body, echoes, stream, clock))
        finals = await ctx.final_outputs(stream, request, clock)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = []
        for i, final in enumerate(finals):
            for completion in final.outputs:
                echo = echoes[i] if echoes else ""
                logprobs = None
                if body.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offset = 0
                    if echoes:
                        offset = self._add_logprobs(
                            logprobs, final.prompt_token_ids, final.prompt_logprobs, 0
                        )
                    self._add_logprobs(logprobs, completion.token_ids, completion.logprobs, offset)
                choices.append(
                    CompletionChoice(
                        index=i * body.n + completion.index,
                        text=echo + completion.text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        return ctx.full_response(CompletionResponse, response_id, choices, finals)

    async def _chunks(
        self,
        response_id: str,
        body: CompletionRequest,
        echoes: list[str] | None,
        stream: RequestStream,
        clock: RequestClock,
    ) -> AsyncIterator[CompletionResponse]:
        ctx = self.ctx
        tracker = DeltaTracker()
        finals: dict[str, RequestOutput] = {}
        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        async for output in ctx.tracked(stream, clock):
            finals[output.request_id] = output
            i = prompt_index(output.request_id)
            choices = []
            for delta in tracker.deltas(i * body.n, output):
                text = delta.text
                logprobs = None if body.logprobs is None else CompletionLogprobs()
                if delta.first and echoes:
                    text = echoes[i] + text
                    if logprobs is not None:
                        offsets[delta.index] = self._add_logprobs(
                            logprobs, output.prompt_token_ids, output.prompt_logprobs, 0
                        )
                if logprobs is not None:
                    c = delta.completion
                    offsets[delta.index] = self._add_logprobs(
                        logprobs,
                        c.token_ids[delta.start :],
                        (c.logprobs or [])[delta.start :],
                        offsets.get(delta.index, 0),
                    )
                choices.append(
                    CompletionChoice(
                        index=delta.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.completion.finish_reason,
                        stop_reason=delta.completion.stop_reason,
                    )
                )
            if choices:
                yield CompletionResponse(
                    id=response_id, created=ctx.created, model=ctx.model_name, choices=choices
                )
        if body.include_usage:
            yield CompletionResponse(
                id=response_id,
                created=ctx.created,
                model=ctx.model_name,
                choices=[],
                usage=usage(list(finals.values())),
            )

    async def _prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [Prompt(None, list(prompt))]
        encode = self.ctx.preparer.encode
        texts = [p for p in prompt if isinstance(p, str)]
        ids = iter(await asyncio.gather(*(encode(p) for p in texts)))
        return [
            Prompt(p, next(ids)) if isinstance(p, str) else Prompt(None, list(p)) for p in prompt
        ]

    async def _echo_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return await self.ctx.preparer.decode(prompt.token_ids, "prompt")

    def _add_logprobs(
        self,
        into: CompletionLogprobs,
        token_ids: list[int],
        positions: list[PositionLogprobs | None] | None,
        offset: int,
    ) -> int:
        """Append one entry per token; return the text offset after the last one."""
        positions = positions or [None] * len(token_ids)
        for token_id, position in zip(token_ids, positions):
            text = self._token_text(token_id, position)
            into.tokens.append(text)
            into.text_offset.append(offset)
            offset += len(text)
            if position is None:
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(position[token_id].logprob)
            # Keyed by text, as OpenAI does: tokens that decode alike keep the best logprob.
            top: dict[str, float] = {}
            for t, lp in sorted(position.items(), key=lambda item: -item[1].logprob):
                top.setdefault(self._token_text(t, position), lp.logprob)
            into.top_logprobs.append(top)
        return offset

    def _token_text(self, token_id: int, position: PositionLogprobs | None) -> str:
        entry = position.get(token_id) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.ctx.engine.tokenizer is None:
            return f"token_id:{token_id}"
        return self.ctx.engine.tokenizer.decode([token_id])
