"""The event-loop end of an engine front (``AsyncEngine``, ``ProcessEngine``): what a caller
submits, the stream it reads back, and how results reach the caller's event loop."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from platform_core.engine.outputs import RequestOutput
from platform_core.errors import DeadlineExceededError, EngineDeadError, StreamBackpressureError
from platform_core.lora_request import LoRARequest
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
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    kv_transfer_params: dict[str, Any] | None = None  # for the KV connector (disaggregation)


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


def land_on_loops(results: list[tuple[StreamSink, object]]) -> list[asyncio.AbstractEventLoop]:
    """From any thread: hand each result to its sink on the sink's event loop, one
    ``call_soon_threadsafe`` per loop; return the loops found closed (nobody listens there)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamSink, object]]] = defaultdict(list)
    for sink, item in results:
        by_loop[sink.loop].append((sink, item))
    closed = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(StreamSink.land, batch)
        except RuntimeError:  # that event loop is closed
            closed.append(loop)
    return closed


async def accepted_stream(
    requests: list[GenerateRequest], sink: StreamSink, abort: Callable[[list[str]], None]
) -> RequestStream:
    """Wait until ``sink`` hears that the submitted ``requests`` were accepted; their stream.

    Raises the engine's refusal; ``DeadlineExceededError`` when the group's earliest deadline
    passes first. Cancelling the wait or a deadline aborts the requests.
    """
    ids = [r.request_id for r in requests]
    deadlines = [r.deadline for r in requests if r.deadline is not None]
    try:
        async with asyncio.timeout(min(deadlines) - time.monotonic() if deadlines else None):
            await sink.accepted
    except TimeoutError:
        abort(ids)
        raise DeadlineExceededError(
            "the deadline passed before the engine accepted the request"
        ) from None
    except asyncio.CancelledError:
        abort(ids)
        raise
    return RequestStream(ids, sink, abort)


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
    """What the server uses of an engine (in a thread, in a process, or several behind a
    router), and ``generate`` for anything that can ``submit`` a group of requests.

    Besides ``submit``, ``abort`` and ``shutdown``: ``is_running``, ``error`` (why it stopped,
    ``None`` after a plain shutdown), ``stats()``, the front's own ``tokenizer`` copy and the
    model's ``max_model_len``, ``eos_token_ids``, ``vocab_size`` and ``default_sampling``.
    """

    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    default_sampling: dict[str, Any]
    error: EngineDeadError | None

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Engine counters (see ``LLMEngine.stats``) as of the latest step."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (from any thread); a no-op once the engine has stopped."""
        raise NotImplementedError

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop after the current step (requests left get ``EngineDeadError``) and wait."""
        raise NotImplementedError

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
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; leaving early aborts it."""
        request = GenerateRequest(
            request_id, prompt, params, prompt_token_ids, lora_request=lora_request
        )
        stream = await self.submit([request])
        async with aclosing(aiter(stream)) as outputs:
            async for output in outputs:
                yield output
