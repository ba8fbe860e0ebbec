"""What the completion and chat handlers share: model check, request limits, submitting prompts,
reading outputs (with metrics, deadlines and disconnect detection), per-choice deltas, SSE
framing, usage."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.llm_engine import DEADLINE_EXCEEDED
from platform_core.engine.outputs import CompletionOutput, RequestOutput
from platform_core.engine.request_stream import GenerateRequest, RequestStream
from platform_core.entrypoints.openai.deadline import Drain, RequestClock
from platform_core.entrypoints.openai.errors import (
    ModelNotFoundError,
    RequestTimeoutError,
    error_event,
)
from platform_core.entrypoints.openai.limits import RequestLimits
from platform_core.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from platform_core.entrypoints.openai.prepare import Preparer
from platform_core.entrypoints.openai.protocol import (
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from platform_core.errors import InvalidRequestError, RequestFailedError
from platform_core.sampling_params import SamplingParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class Prompt:
    """One prompt, tokenized on the HTTP side; ``text`` is kept for echo when it was text."""

    text: str | None
    token_ids: list[int]


@dataclass
class ServerContext:
    """State every route shares: the engine, the served model's name, the metrics, the
    tokenizing threads, the request limits and the shutdown deadline."""

    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    preparer: Preparer
    limits: RequestLimits = field(default_factory=RequestLimits)
    return_tokens_as_token_ids: bool = False
    trust_request_chat_template: bool = False
    drain: Drain = field(default_factory=Drain)
    created: int = field(default_factory=lambda: int(time.time()))

    def full_response(
        self,
        response_type: type[BaseModel],
        response_id: str,
        choices: list[Any],
        finals: list[RequestOutput],
    ) -> Response:
        """A whole (non-streamed) response: ``response_type`` with ``choices`` and the fields
        every response shares (id, created, model, usage over ``finals``)."""
        body = response_type(
            id=response_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage(finals),
        )
        return Response(body.model_dump_json(), media_type="application/json")

    def check_model(self, model: str | None) -> None:
        """An absent model means the served one; any other name is a 404."""
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model)

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
    ) -> RequestStream:
        """Send every prompt to the engine as one group; ``request_id-i`` is prompt ``i``.

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
            GenerateRequest(f"{request_id}-{i}", p.text, params, p.token_ids, now, deadline)
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


@dataclass(slots=True)
class Delta:
    """What one choice gained since its previous chunk (``start``: index of its first new token)."""

    index: int
    text: str
    start: int
    completion: CompletionOutput
    first: bool


class DeltaTracker:
    """Turns cumulative outputs into per-choice increments for streaming."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int, bool]] = {}  # choice -> (chars, tokens, finished)

    def deltas(self, first_index: int, output: RequestOutput) -> list[Delta]:
        """Increments of ``output``'s samples; sample ``i`` is choice ``first_index + i``."""
        deltas = []
        for completion in output.outputs:
            index = first_index + completion.index
            sent = self._sent.get(index)
            chars, tokens, done = sent or (0, 0, False)
            if done:
                continue
            text = completion.text[chars:]
            changed = text or len(completion.token_ids) > tokens or completion.finished
            if sent is not None and not changed:
                continue
            deltas.append(Delta(index, text, tokens, completion, first=sent is None))
            self._sent[index] = (
                len(completion.text),
                len(completion.token_ids),
                completion.finished,
            )
        return deltas


def usage(finals: list[RequestOutput]) -> UsageInfo:
    """Token counts over a response's requests (a prompt counts once whatever ``n`` is)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in finals)
        ),
    )


# Characters JSON may leave raw inside strings that line readers (Python's splitlines, which
# httpx and so the OpenAI SDK use) treat as line breaks: escaped, an event stays one line.
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(json_text: str) -> str:
    """One server-sent event carrying ``json_text``, on a single line whatever the text holds."""
    return f"data: {json_text.translate(_LINE_BREAKS_IN_JSON)}\n\n"


def event_stream(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` per chunk, an error event if the stream breaks,
    then ``data: [DONE]``."""

    async def events() -> AsyncIterator[str]:
        try:
            async with aclosing(chunks) as items:
                async for chunk in items:
                    yield sse_data(chunk.model_dump_json())
        except Exception as exc:  # the status line is sent already: report in-band
            yield error_event(exc)
        yield SSE_DONE

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
