"""The event-loop end of ``AsyncEngine``: what a caller submits and the stream it reads back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from platform_core.engine.outputs import RequestOutput
from platform_core.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One request for the engine thread: already tokenized when ``prompt_token_ids`` is set."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    arrival_time: float = field(default_factory=time.time)
    deadline: float | None = None  # time.monotonic() seconds; the engine aborts it after


class StreamSink:
    """Where the engine thread sends a submission's results, on the submitter's event loop.

    ``accepted`` resolves once the engine has added the requests (or fails with the reason it
    could not); ``queue`` then receives ``RequestOutput``s, or an exception if the engine stops.
    """

    ACCEPTED = object()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @staticmethod
    def land(batch: list[tuple[StreamSink, object]]) -> None:
        """Runs on the sink's loop: hand each result to its future or queue."""
        for sink, item in batch:
            if not sink.accepted.done():
                if isinstance(item, BaseException):
                    sink.accepted.set_exception(item)
                    continue
                sink.accepted.set_result(None)
            if item is not StreamSink.ACCEPTED:
                sink.queue.put_nowait(item)  # type: ignore[arg-type]


class RequestStream:
    """The outputs of a group of accepted requests, as they grow, until all have finished.

    Outputs are cumulative, so when a reader falls behind only each request's newest output is
    yielded. Iterate once. Leaving early (``break``, cancellation, an error) aborts every request
    of the group that has not finished.
    """

    def __init__(
        self,
        request_ids: list[str],
        outputs: asyncio.Queue[RequestOutput | BaseException],
        abort: Callable[[list[str]], None],
    ) -> None:
        self.request_ids = request_ids
        self._queue = outputs
        self._abort = abort

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        unfinished = set(self.request_ids)
        try:
            while unfinished:
                for output in self._newest(await self._queue.get()):
                    if output.finished:
                        unfinished.discard(output.request_id)
                    yield output
        finally:
            if unfinished:
                self._abort(sorted(unfinished))

    def _newest(self, item: RequestOutput | BaseException) -> list[RequestOutput]:
        newest: dict[str, RequestOutput] = {}
        while True:
            if isinstance(item, BaseException):
                raise item
            newest[item.request_id] = item
            if self._queue.empty():
                return list(newest.values())
            item = self._queue.get_nowait()


class SubmitFront:
    """``generate`` for anything that can ``submit`` a group of requests (engines, routers)."""

    async def submit(self, requests: list[GenerateRequest]) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; leaving early aborts it."""
        stream = await self.submit([GenerateRequest(request_id, prompt, params, prompt_token_ids)])
        async with aclosing(aiter(stream)) as outputs:
            async for output in outputs:
                yield output
