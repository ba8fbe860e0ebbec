"""``POST /v1/completions``: text completion of one or many prompts, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import Response

from platform_core.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from platform_core.engine.request_stream import RequestStream
from platform_core.entrypoints.openai.deadline import RequestClock
from platform_core.entrypoints.openai.protocol import CompletionRequest
from platform_core.entrypoints.openai.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from platform_core.entrypoints.openai.responses import (
    DeltaTracker,
    event_stream,
    format_prompt_logprobs,
    kv_transfer_params,
    usage,
    with_ignored_header,
)
from platform_core.entrypoints.openai.serving_base import (
    Prompt,
    ServerContext,
    new_id,
    prompt_index,
)
from platform_core.entrypoints.openai.serving_beam import submit_or_search
from platform_core.errors import InvalidRequestError

# OpenAI's default for completions; chat defaults to the room left in the context.
DEFAULT_MAX_TOKENS = 16


def _last(token_ids: list[int], keep_last: int | None) -> list[int]:
    return list(token_ids if keep_last is None else token_ids[-keep_last:])


def _generated(
    text: str, completion: CompletionOutput, start: int, echo_only: bool
) -> tuple[str, list[int], list[PositionLogprobs] | None]:
    """``text`` with the ids and logprobs of ``completion`` from token ``start`` on: what a
    choice returns of what was generated (nothing with echo only)."""
    if echo_only:
        return "", [], []
    return text, completion.token_ids[start:], (completion.logprobs or [])[start:]


def _num_prompts(prompt: str | list) -> int:
    """How many prompts ``prompt`` holds (a flat list of ints is one prompt of token ids)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one completion request returns besides the generated text."""

    echoes: list[str] | None  # prompt texts to prepend (``echo``)
    echo_only: bool  # ``echo`` with ``max_tokens: 0``: the prompt and nothing generated
    logprobs: bool
    prompt_logprobs: bool
    token_ids: bool  # ``return_token_ids``
    tokens_as_ids: bool  # logprob tokens written ``token_id:N``
    continuous_usage: bool


class CompletionServing:
    """Handles completion requests against one ``ServerContext``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        """Validate, submit every prompt, then answer with JSON or an event stream."""
        ctx = self.ctx
        created = int(time.time())
        clock = ctx.drain.clock(body.deadline())
        ignored = ctx.check_request(body, "completions")
        lora = ctx.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of must be omitted or equal to n", "best_of")
        if body.suffix:
            raise InvalidRequestError(
                "suffix (fill-in-the-middle) is not supported; omit it or send an empty one",
                "suffix",
            )
        ctx.check_limits(body, _num_prompts(body.prompt))
        logprobs = ctx.logprob_count(body.logprobs, "logprobs")
        prompt_logprobs = ctx.logprob_count(body.prompt_logprobs, "prompt_logprobs")
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = logprobs  # echo with logprobs scores the prompt too
        prompts = await clock.bound(self._prompts(body.prompt, ctx.keep_last(body)))
        echoes = None
        if body.echo:
            echoes = await clock.bound(asyncio.gather(*(self._echo_text(p) for p in prompts)))
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = ctx.engine.default_sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        params = body.sampling_params(
            ctx.engine.default_sampling,
            # The engine generates at least one token; with echo only it is dropped.
            max_tokens=1 if echo_only else max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        plan = _Plan(
            echoes,
            echo_only,
            logprobs is not None,
            prompt_logprobs is not None,
            body.return_token_ids,
            ctx.tokens_as_ids(body),
            body.stream_options is not None and body.stream_options.continuous_usage_stats,
        )
        response_id = new_id("cmpl")
        stream = await submit_or_search(ctx, body, response_id, prompts, params, clock, lora)
        model = ctx.response_model(lora)
        if body.stream:
            chunks = self._chunks(response_id, created, model, body, plan, stream, clock)
            return with_ignored_header(event_stream(chunks), ignored)
        finals = await ctx.final_outputs(stream, request, clock)
        if finals is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        choices = []
        for i, final in enumerate(finals):
            for completion in final.outputs:
                text, ids, positions = _generated(completion.text, completion, 0, echo_only)
                logprobs_out = None
                if plan.logprobs:
                    logprobs_out = CompletionLogprobs()
                    offset = 0
                    if echoes:
                        offset = self._add_logprobs(
                            logprobs_out, final.prompt_token_ids, final.prompt_logprobs, 0, plan
                        )
                    self._add_logprobs(logprobs_out, ids, positions, offset, plan)
                choices.append(
                    CompletionChoice(
                        index=i * body.n + completion.index,
                        text=(echoes[i] if echoes else "") + text,
                        logprobs=logprobs_out,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        token_ids=ids if plan.token_ids else None,
                        prompt_token_ids=final.prompt_token_ids if plan.token_ids else None,
                        prompt_logprobs=(
                            format_prompt_logprobs(final.prompt_logprobs)
                            if plan.prompt_logprobs
                            else None
                        ),
                    )
                )
        response = ctx.full_response(
            CompletionResponse,
            response_id,
            created,
            model,
            choices,
            usage(finals, count_completions=not echo_only),
            kv_transfer_params=kv_transfer_params(finals),
        )
        return with_ignored_header(response, ignored)

    async def _chunks(
        self,
        response_id: str,
        created: int,
        model: str,
        body: CompletionRequest,
        plan: _Plan,
        stream: RequestStream,
        clock: RequestClock,
    ) -> AsyncIterator[CompletionResponse]:
        """One chunk per choice delta (what OpenAI's and vLLM's clients read)."""
        ctx = self.ctx
        tracker = DeltaTracker()
        finals: dict[str, RequestOutput] = {}
        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        count = not plan.echo_only
        async for output in ctx.tracked(stream, clock):
            finals[output.request_id] = output
            i = prompt_index(output.request_id)
            for delta in tracker.deltas(i * body.n, output):
                text, ids, positions = _generated(
                    delta.text, delta.completion, delta.start, plan.echo_only
                )
                logprobs = CompletionLogprobs() if plan.logprobs else None
                if delta.first and plan.echoes:
                    text = plan.echoes[i] + text
                    if logprobs is not None:
                        offsets[delta.index] = self._add_logprobs(
                            logprobs, output.prompt_token_ids, output.prompt_logprobs, 0, plan
                        )
                if logprobs is not None:
                    offsets[delta.index] = self._add_logprobs(
                        logprobs, ids, positions, offsets.get(delta.index, 0), plan
                    )
                first_ids = plan.token_ids and delta.first
                choice = CompletionChoice(
                    index=delta.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=delta.completion.finish_reason,
                    stop_reason=delta.completion.stop_reason,
                    token_ids=ids if plan.token_ids else None,
                    prompt_token_ids=output.prompt_token_ids if first_ids else None,
                )
                yield CompletionResponse(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=usage([output], count) if plan.continuous_usage else None,
                    kv_transfer_params=delta.kv_transfer_params,
                )
        if ctx.include_usage(body):
            yield CompletionResponse(
                id=response_id,
                created=created,
                model=model,
                choices=[],
                usage=usage(list(finals.values()), count),
            )

    async def _prompts(self, prompt: str | list, keep_last: int | None) -> list[Prompt]:
        """The prompts, tokenized; only the last ``keep_last`` tokens of each if given."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        encode = self.ctx.preparer.encode
        texts = [p for p in prompt if isinstance(p, str)]
        ids = iter(await asyncio.gather(*(encode(p, True, "prompt", keep_last) for p in texts)))
        return [
            Prompt(p, next(ids)) if isinstance(p, str) else Prompt(None, _last(p, keep_last))
            for p in prompt
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
        plan: _Plan,
    ) -> int:
        """Append one entry per token; return the text offset after the last one."""
        positions = positions or [None] * len(token_ids)
        for token_id, position in zip(token_ids, positions):
            text = self._token_text(token_id, position, plan.tokens_as_ids)
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
                top.setdefault(self._token_text(t, position, plan.tokens_as_ids), lp.logprob)
            into.top_logprobs.append(top)
        return offset

    def _token_text(
        self, token_id: int, position: PositionLogprobs | None, as_id: bool = False
    ) -> str:
        if as_id:
            return f"token_id:{token_id}"
        entry = position.get(token_id) if position else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.ctx.engine.tokenizer is None:
            return f"token_id:{token_id}"
        return self.ctx.engine.tokenizer.decode([token_id])
