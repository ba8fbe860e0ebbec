"""The engine loop on its own thread, driven from asyncio: ``AsyncEngine``.

Callers tokenize on their side (``AsyncEngine.tokenizer`` is their own copy) and send typed
commands (``Submit``, ``Abort``, ``Shutdown``) through a thread-safe queue. The engine thread
applies them between steps (validating submissions: an ``InvalidRequestError`` goes back to the
caller), steps while any request is unfinished, and sleeps on the queue when idle. Each step's
outputs go back with one ``call_soon_threadsafe`` per event loop, into the asyncio queue of the
``RequestStream`` that submitted them.

Why a thread rather than a process: model steps spend their time in torch kernels, which release
the GIL, so HTTP work and model steps overlap; the engine stays inspectable in-process (tests check
its KV pool) and start-up and shutdown stay simple. The commands are plain dataclasses, so moving
the loop into a process later changes the transport, not the protocol. Detokenization and stop
strings stay in the engine thread because stop strings decide when a request ends.

The engine is also built on that thread. OpenMP (torch's CPU thread pool) keeps one pool of
workers per thread that starts parallel regions; a model loaded on the main thread and stepped on
another leaves two pools, more OpenMP threads than cores, and libgomp then stops its workers from
spinning between regions, so every kernel pays a wake-up: a decode step of 8 requests on a 2-core
CPU took 12.5 ms instead of 8 (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.request_stream import (
    GenerateRequest,
    RequestStream,
    StreamSink,
    SubmitFront,
)
from platform_core.errors import DeadlineExceededError, EngineDeadError

logger = logging.getLogger("platform_core.engine")

# How often an idle engine checks that its model workers are alive, so that a dead tensor-parallel
# worker stops the engine (``is_running`` false, ``/health`` 503) within seconds even with no
# traffic; a busy engine notices at its next step. A check is a few ``is_alive`` calls.
IDLE_HEALTH_CHECK_S = 1.0


@dataclass(slots=True)
class Submit:
    """Add these requests together; all are accepted or none."""

    requests: list[GenerateRequest]
    sink: StreamSink


@dataclass(slots=True)
class Abort:
    """Stop these requests now and free their blocks (unknown ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class Shutdown:
    """Leave the loop; requests still running get ``EngineDeadError``."""


Command = Submit | Abort | Shutdown


class AsyncEngine(SubmitFront):
    """Runs an ``LLMEngine`` on a dedicated thread; ``generate`` streams its outputs.

    Thread ownership: after construction only the engine thread touches ``engine`` (reading its
    attributes for inspection is fine); ``tokenizer`` is a separate copy for the event loop side.
    """

    def __init__(self, make_engine: Callable[[], LLMEngine]) -> None:
        """Build the engine with ``make_engine`` on the engine thread and start its loop; an
        error building it is raised here."""
        self.error: EngineDeadError | None = None  # set when the loop failed (not on shutdown)
        self._stopped: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Owned by the engine thread: whose outputs go where, and what is not yet delivered.
        self._sinks: dict[str, StreamSink] = {}
        self._results: list[tuple[StreamSink, object]] = []
        built: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(make_engine, built), name="platform-core-engine", daemon=True
        )
        self._thread.start()
        failure = built.get()
        if failure is not None:
            self._thread.join()
            raise failure

    def _adopt(self, engine: LLMEngine) -> None:
        """Take ``engine`` and the copies of its settings the event loop side reads."""
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.eos_token_ids = engine.eos_token_ids
        self.vocab_size = engine.vocab_size
        self.default_sampling = dict(engine.default_sampling)
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model described by ``config`` and start the engine thread."""
        return cls(lambda: LLMEngine(config))

    # ------------------------------------------------------------------ event loop side
    @property
    def is_running(self) -> bool:
        return self._stopped is None

    def stats(self) -> dict[str, Any]:
        """Engine counters as of the end of the latest loop iteration (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    async def submit(
        self, requests: list[GenerateRequest], *, max_buffered_tokens: int | None = None
    ) -> RequestStream:
        """Queue ``requests`` together and return their stream once the engine accepted them.

        Raises the engine's ``InvalidRequestError`` (nothing is left running),
        ``EngineDeadError``, or ``DeadlineExceededError`` when the group's earliest deadline
        passes before acceptance (e.g. during a long step); cancelling the wait or a deadline
        aborts the requests. See ``SubmitFront.submit`` for ``max_buffered_tokens``.
        """
        ids = [r.request_id for r in requests]
        sink = StreamSink(asyncio.get_running_loop(), ids, self.abort, max_buffered_tokens)
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        self._send(Submit(requests, sink))
        try:
            async with asyncio.timeout(min(deadlines) - time.monotonic() if deadlines else None):
                await sink.accepted
        except TimeoutError:
            self.abort(ids)
            raise DeadlineExceededError(
                "the deadline passed before the engine accepted the request"
            ) from None
        except asyncio.CancelledError:
            self.abort(ids)
            raise
        return RequestStream(ids, sink, self.abort)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (from any thread); a no-op once the engine has stopped."""
        with self._lock:
            if self._stopped is None:
                self._commands.put(Abort(list(request_ids)))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step and wait for the thread to end."""
        with self._lock:
            if self._stopped is None:
                self._commands.put(Shutdown())
        self._thread.join(timeout)

    def _send(self, command: Command) -> None:
        with self._lock:
            if self._stopped is not None:
                raise EngineDeadError(str(self._stopped))
            self._commands.put(command)

    # ------------------------------------------------------------------ engine thread
    def _run(
        self, make_engine: Callable[[], LLMEngine], built: queue.SimpleQueue[BaseException | None]
    ) -> None:
        try:
            self._adopt(make_engine())
        except BaseException as exc:  # the constructor raises it
            built.put(exc)
            return
        built.put(None)
        try:
            self._loop()
            reason = EngineDeadError("the engine has been shut down")
        except BaseException as exc:  # any failure ends the loop the same way
            logger.exception("the engine loop failed; failing every request")
            reason = EngineDeadError(f"the engine loop failed: {exc!r}")
            self.error = reason
        with self._lock:
            self._stopped = reason
        self._fail_everything(reason)
        try:
            self.engine.shutdown()  # worker processes, if the executor has any
        except Exception:  # stopping must not fail; the reason is logged
            logger.exception("stopping the engine's executor failed")

    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            self._results = results = []
            keep_going = True
            aborts: list[str] = []  # consecutive aborts go to the engine as one batch
            for command in self._take_commands(block=idle):
                if isinstance(command, Abort):
                    aborts += command.request_ids
                    continue
                self._abort(aborts)
                if isinstance(command, Shutdown):
                    keep_going = False
                else:
                    results.append((command.sink, self._add(command)))
            self._abort(aborts)
            if results:  # acceptances go out now, not after a step that may be long
                self._deliver(results)
                self._results = results = []
            if keep_going and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    find = self._sinks.pop if output.finished else self._sinks.get
                    sink = find(output.request_id, None)
                    if sink is not None:
                        results.append((sink, output))
            self._stats = self.engine.stats()
            self._results = []
            self._deliver(results)
            if not keep_going:
                return

    def _abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` in the engine and forget their sinks; empties the list."""
        if request_ids:
            self.engine.abort_request(request_ids)
            for request_id in request_ids:
                self._sinks.pop(request_id, None)
            request_ids.clear()

    def _take_commands(self, block: bool) -> list[Command]:
        """The commands queued now; when ``block``, wait for one, checking the workers'
        health every ``IDLE_HEALTH_CHECK_S`` meanwhile (a dead worker raises)."""
        commands: list[Command] = []
        while block and not commands:
            try:
                commands.append(self._commands.get(timeout=IDLE_HEALTH_CHECK_S))
            except queue.Empty:
                self.engine.check_health()
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: Submit) -> object:
        """Add a group of requests; on any error remove the ones added and return the error."""
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(
                    r.request_id,
                    r.prompt,
                    r.params,
                    r.prompt_token_ids,
                    r.arrival_time,
                    deadline=r.deadline,
                )
                added.append(r.request_id)
        except Exception as exc:  # the caller gets the error; the loop goes on
            self.engine.abort_request(added)
            return exc
        for request_id in added:
            self._sinks[request_id] = command.sink
        return StreamSink.ACCEPTED

    def _deliver(self, results: list[tuple[StreamSink, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamSink, object]]] = defaultdict(
            list
        )
        for sink, item in results:
            by_loop[sink.loop].append((sink, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(StreamSink.land, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                self._abort([rid for rid, s in self._sinks.items() if s.loop is loop])

    def _fail_everything(self, reason: EngineDeadError) -> None:
        sinks = {id(s): s for s in self._sinks.values()}
        sinks.update((id(sink), sink) for sink, _ in self._results)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Submit):
                sinks[id(command.sink)] = command.sink
        try:
            self.engine.abort_request(list(self._sinks))
        except Exception:  # the engine may be broken; callers must still hear
            logger.exception("aborting requests after the engine loop stopped failed")
        self._sinks.clear()
        self._deliver([(sink, EngineDeadError(str(reason))) for sink in sinks.values()])
