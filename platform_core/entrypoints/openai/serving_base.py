"""What the completion and chat handlers share on the way in and while they wait: the request
checks (fields, limits, options, model), submitting prompts, and reading outputs with metrics,
deadlines and disconnect detection. Shaping the answers is ``responses``."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from platform_core.engine.llm_engine import DEADLINE_EXCEEDED
from platform_core.engine.outputs import RequestOutput
from platform_core.engine.request_stream import GenerateRequest, RequestStream, SubmitFront
from platform_core.entrypoints.openai.deadline import Drain, RequestClock
from platform_core.entrypoints.openai.errors import RequestTimeoutError
from platform_core.entrypoints.openai.limits import RequestLimits
from platform_core.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from platform_core.entrypoints.openai.prepare import Preparer
from platform_core.entrypoints.openai.protocol import SamplingRequest
from platform_core.entrypoints.openai.request_base import ignored_fields
from platform_core.entrypoints.openai.response_bodies import UsageInfo
from platform_core.entrypoints.openai.serving_models import ServedModels
from platform_core.errors import InvalidRequestError, RequestFailedError
from platform_core.lora_request import LoRARequest
from platform_core.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger("platform_core.server")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """Server-wide protocol switches (``serve`` flags).

    ``strict_request_fields``: an unknown request field is a 400 instead of being ignored.
    ``return_tokens_as_token_ids``: logprob tokens are ``token_id:N`` for every request.
    ``enable_force_include_usage``: every stream ends with a usage chunk.
    ``trust_request_chat_template``: a request may bring its own ``chat_template``.
    ``reasoning_parser``, ``tool_call_parser``, ``enable_auto_tool_choice``: how chat replies
    are split into reasoning, content and tool calls (the engine config keys of those names).
    """

    strict_request_fields: bool = False
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


@dataclass(slots=True)
class Prompt:
    """One prompt, tokenized on the HTTP side; ``text`` is kept for echo when it was text."""

    text: str | None
    token_ids: list[int]


@dataclass
class ServerContext:
    """State every route shares: the engine, the served models (base and LoRA adapters), the
    metrics, the tokenizing threads, the request limits, the protocol options and the shutdown
    deadline."""

    engine: SubmitFront
    models: ServedModels
    metrics: ServerMetrics
    preparer: Preparer
    limits: RequestLimits = field(default_factory=RequestLimits)
    options: ServingOptions = field(default_factory=ServingOptions)
    drain: Drain = field(default_factory=Drain)
    created: int = field(default_factory=lambda: int(time.time()))

    def full_response(
        self,
        response_type: type[BaseModel],
        response_id: str,
        created: int,
        model: str,
        choices: list[Any],
        usage_info: UsageInfo,
        **fields: Any,
    ) -> Response:
        """A whole (non-streamed) response: ``response_type`` with ``choices``, ``fields`` and
        what every response has (id, its own creation time, model, usage)."""
        body = response_type(
            id=response_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage_info,
            **fields,
        )
        return Response(body.model_dump_json(), media_type="application/json")

    def check_fields(self, body: BaseModel, route: str) -> list[str]:
        """The unknown fields ``body`` has, which the server ignores (logged here, once per
        request), or a 400 naming the first with ``strict_request_fields``."""
        ignored = ignored_fields(body)
        if ignored and self.options.strict_request_fields:
            raise InvalidRequestError(
                f"unsupported parameter {ignored[0]!r} (the server runs with "
                "--strict-request-fields)",
                ignored[0],
            )
        if ignored:
            logger.info("%s: ignored unknown request fields: %s", route, ", ".join(ignored))
        return ignored

    def check_request(self, body: SamplingRequest, route: str) -> list[str]:
        """Checks every generation request gets first; returns the unknown fields it ignores
        (``check_fields``)."""
        ignored = self.check_fields(body, route)
        if body.stream_options is not None and not body.stream:
            raise InvalidRequestError("stream_options needs stream: true", "stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise InvalidRequestError(
                "prompt_logprobs are not available when streaming", "prompt_logprobs"
            )
        limit = self.engine.max_model_len
        if body.truncate_prompt_tokens is not None and not (
            body.truncate_prompt_tokens == -1 or 1 <= body.truncate_prompt_tokens <= limit
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 (the context) or in [1, {limit}] (the "
                f"model's context), got {body.truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        return ignored

    def keep_last(self, body: SamplingRequest) -> int | None:
        """How many prompt tokens ``truncate_prompt_tokens`` keeps (``None``: all)."""
        if body.truncate_prompt_tokens == -1:
            return self.engine.max_model_len
        return body.truncate_prompt_tokens

    def include_usage(self, body: SamplingRequest) -> bool:
        """Whether a stream ends with a usage chunk (asked, or forced by the server)."""
        options = body.stream_options
        asked = options is not None and (options.include_usage or options.continuous_usage_stats)
        return asked or self.options.enable_force_include_usage

    def tokens_as_ids(self, body: SamplingRequest) -> bool:
        """Whether logprob tokens are written ``token_id:N``."""
        return body.return_tokens_as_token_ids or self.options.return_tokens_as_token_ids

    def logprob_count(self, value: int | None, name: str) -> int | None:
        """``value`` with -1 read as the whole vocabulary (vLLM's meaning), bounded by
        ``MAX_LOGPROBS`` (vLLM's default ``--max-logprobs``)."""
        if value is None or 0 <= value <= MAX_LOGPROBS:
            return value
        if value == -1:
            raise InvalidRequestError(
                f"{name}=-1 asks for the whole vocabulary ({self.engine.vocab_size} tokens); at "
                f"most {MAX_LOGPROBS} are returned per token",
                name,
            )
        raise InvalidRequestError(
            f"{name} must be -1 (the whole vocabulary) or in [0, {MAX_LOGPROBS}], got {value}",
            name,
        )

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names; ``None`` for the base model (also when absent); a
        name served neither way is a 404."""
        return self.models.resolve(model)

    def response_model(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response reports: the adapter's name, else the base model's."""
        return self.models.base_name if lora is None else lora.lora_name

    def check_limits(self, body: SamplingRequest, num_prompts: int) -> None:
        """Refuse a request over ``self.limits`` (400 naming the field and the bound) before
        any of it is tokenized or queued."""
        limits = self.limits
        if num_prompts > limits.max_prompts:
            raise InvalidRequestError(
                f"{num_prompts} prompts in one request; at most {limits.max_prompts} are "
                "allowed (--max-prompts-per-request)",
                "prompt",
            )
        if num_prompts * body.n > limits.max_choices:
            raise InvalidRequestError(
                f"n={body.n} x {num_prompts} prompts asks for {num_prompts * body.n} choices; at "
                f"most {limits.max_choices} are allowed (--max-choices-per-request)",
                "n",
            )
        for name in ("allowed_token_ids", "stop_token_ids", "logit_bias"):
            values = getattr(body, name)
            if values is not None and len(values) > limits.max_token_id_list:
                raise InvalidRequestError(
                    f"{name} has {len(values)} entries; at most {limits.max_token_id_list} are "
                    "allowed (--max-token-id-list-length)",
                    name,
                )

    async def submit(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        clock: RequestClock,
        lora: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Send every prompt to the engine as one group, run with the adapter ``lora`` if
        given, and ``kv_transfer_params`` for the KV connector; ``request_id-i`` is prompt ``i``.

        The wait for acceptance runs under ``clock``; its deadline also reaches the engine,
        which aborts the requests wherever they are.
        """
        for p in prompts:
            # min_tokens beyond the context can never be met: refuse rather than cut short.
            room = self.engine.max_model_len - len(p.token_ids)
            if 0 < room < params.min_tokens:
                raise InvalidRequestError(
                    f"min_tokens={params.min_tokens} does not fit: the prompt leaves room for "
                    f"{room} tokens in the {self.engine.max_model_len}-token context",
                    "min_tokens",
                )
        now, deadline = time.time(), clock.deadline
        requests = [
            GenerateRequest(
                f"{request_id}-{i}",
                p.text,
                params,
                p.token_ids,
                now,
                deadline,
                lora,
                kv_transfer_params,
            )
            for i, p in enumerate(prompts)
        ]
        # A client that stops reading is aborted once every choice lags by the per-choice limit.
        buffer_limit = self.limits.max_stream_buffer_tokens * len(prompts) * params.n
        # Cancelling the wait (a deadline, the drain) aborts the requests in the engine.
        return await clock.bound(self.engine.submit(requests, max_buffered_tokens=buffer_limit))

    async def tracked(
        self, stream: RequestStream, clock: RequestClock
    ) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, recorded in the metrics as they pass.

        When a deadline of ``clock`` passes, the stream's requests are aborted and
        ``RequestTimeoutError`` or ``ServerShuttingDownError`` is raised.
        """
        trackers: dict[str, RequestTracker] = {}
        async with aclosing(aiter(stream)) as outputs:
            while True:
                try:
                    output = await clock.bound(anext(outputs))
                except StopAsyncIteration:
                    return
                if output.error is not None:
                    if output.error == DEADLINE_EXCEEDED:
                        raise RequestTimeoutError()
                    raise RequestFailedError(f"the request failed in the engine: {output.error}")
                tracker = trackers.get(output.request_id)
                if tracker is None:
                    tracker = trackers[output.request_id] = self.metrics.track()
                tracker.observe(output)
                yield output

    async def final_outputs(
        self, stream: RequestStream, request: Request, clock: RequestClock
    ) -> list[RequestOutput] | None:
        """Each request's last output, in submission order; ``None`` if the client left."""

        async def collect() -> list[RequestOutput]:
            finals: dict[str, RequestOutput] = {}
            async with aclosing(self.tracked(stream, clock)) as outputs:
                async for output in outputs:
                    finals[output.request_id] = output
            return [finals[r] for r in stream.request_ids]

        return await unless_disconnected(collect(), request)


def prompt_index(request_id: str) -> int:
    """The prompt position encoded by ``ServerContext.submit``."""
    return int(request_id.rsplit("-", 1)[1])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def unless_disconnected(work: Awaitable[T], request: Request) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
    return task.result() if finished else None
