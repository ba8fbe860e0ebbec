"""The event-loop end of ``AsyncEngine``: what a caller submits and the stream it reads back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from platform_core.engine.outputs import RequestOutput
from platform_core.errors import StreamBackpressureError
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
    could not). Outputs then wait in ``pending`` until the reader ``take``s them; outputs are
    cumulative, so only the newest per request is kept: a reader that stops reading costs at most
    one output per request. With ``max_buffered_tokens`` set, once more tokens than that have
    been generated for the group and not taken, the sink aborts the unfinished requests
    (``abort``) and the stream fails with ``StreamBackpressureError``.
    """

    ACCEPTED = object()

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_ids: list[str],
        abort: Callable[[list[str]], None],
        max_buffered_tokens: int | None = None,
    ) -> None:
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.pending: dict[str, RequestOutput] = {}
        self.error: BaseException | None = None
        self._ready = asyncio.Event()
        self._abort = abort
        self._limit = max_buffered_tokens
        self._unfinished = set(request_ids)
        self._generated: dict[str, int] = {}  # request id -> tokens in its newest output
        self._taken: dict[str, int] = {}  # request id -> tokens in the output last taken
        self._buffered = 0  # generated minus taken, summed over the group

    @staticmethod
    def land(batch: list[tuple[StreamSink, object]]) -> None:
        """Runs on the sink's loop: hand each result to its future or the pending outputs."""
        for sink, item in batch:
            if not sink.accepted.done():
                if isinstance(item, BaseException):
                    sink.accepted.set_exception(item)
                    continue
                sink.accepted.set_result(None)
            if isinstance(item, BaseException):
                sink.fail(item)
            elif item is not StreamSink.ACCEPTED:
                sink.put(item)  # type: ignore[arg-type]

    def put(self, output: RequestOutput) -> None:
        """Keep ``output`` as its request's newest; enforce the buffered-token limit."""
        if self.error is not None:
            return  # the stream has failed: nothing more is read
        request_id = output.request_id
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self._buffered += tokens - self._generated.get(request_id, 0)
        self._generated[request_id] = tokens
        self.pending[request_id] = output
        if output.finished:
            self._unfinished.discard(request_id)
        elif self._limit is not None and self._buffered > self._limit:
            self._abort(sorted(self._unfinished))
            self.fail(
                StreamBackpressureError(
                    f"the client did not read its stream: {self._buffered} generated tokens "
                    f"were not taken (limit {self._limit}); the requests were aborted"
                )
            )
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``; outputs not yet taken are dropped."""
        if self.error is None:
            self.error = error
            self.pending = {}
        self._ready.set()

    async def take(self) -> list[RequestOutput]:
        """Wait for outputs; the newest of each request not yet taken (raises the error)."""
        while not self.pending and self.error is None:
            self._ready.clear()
            await self._ready.wait()
        if self.error is not None:
            raise self.error
        outputs, self.pending = list(self.pending.values()), {}
        for output in outputs:
            request_id = output.request_id
            tokens = self._generated[request_id]
            self._buffered -= tokens - self._taken.get(request_id, 0)
            self._taken[request_id] = tokens
        return outputs


class RequestStream:
    """The outputs of a group of accepted requests, as they grow, until all have finished.

    Outputs are cumulative, so when a reader falls behind only each request's newest output is
    yielded. Iterate once. Leaving early (``break``, cancellation, an error) aborts every request
    of the group that has not finished.
    """

    def __init__(
        self, request_ids: list[str], sink: StreamSink, abort: Callable[[list[str]], None]
    ) -> None:
        self.request_ids = request_ids
        self._sink = sink
        self._abort = abort

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        unfinished = set(self.request_ids)
        try:
            while unfinished:
                for output in await self._sink.take():
                    if output.finished:
                        unfinished.discard(output.request_id)
                    yield output
        finally:
            if unfinished:
                self._abort(sorted(unfinished))


class SubmitFront:
    """``generate`` for anything that can ``submit`` a group of requests (engines, routers)."""

    async def submit(
        self, requests: list[GenerateRequest], *, max_buffered_tokens: int | None = None
    ) -> RequestStream:
        """Queue ``requests`` together; their stream once accepted.

        Waiting for acceptance ends at the group's earliest ``deadline`` with
        ``DeadlineExceededError`` (the requests are aborted). ``max_buffered_tokens`` bounds
        the tokens generated but not yet read, summed over the group (``None``: no bound);
        past it the requests are aborted and the stream raises ``StreamBackpressureError``.
        """
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
