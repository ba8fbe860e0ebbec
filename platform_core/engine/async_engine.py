"""The engine-core loop on a thread of this process, driven from asyncio: ``AsyncEngine``.

Callers tokenize on their side (``AsyncEngine.tokenizer`` is their own copy) and send the typed
commands of ``engine.core`` through a thread-safe queue; the engine thread runs the shared
``EngineCore`` loop over them. Each iteration's results go back with one
``call_soon_threadsafe`` per event loop, into the ``StreamSink`` of the submission.

``serve`` runs the engine core in its own process instead (``ProcessEngine``), so HTTP, JSON and
tokenization no longer share a GIL with the engine; this in-thread mode stays for tests and
notebooks (the engine is inspectable in-process: ``AsyncEngine.engine``) and for
``serve --engine-mode thread``. Model steps spend their time in torch kernels, which release the
GIL, so even here HTTP work and model steps overlap.

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
from collections.abc import Callable
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.core import (
    AbortRequests,
    CoreCommand,
    EngineCore,
    EngineSetup,
    StopCore,
    SubmitGroup,
)
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.request_stream import (
    GenerateRequest,
    RequestStream,
    StreamSink,
    SubmitFront,
    accepted_stream,
    land_on_loops,
)
from platform_core.errors import EngineDeadError

logger = logging.getLogger("platform_core.engine")


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
        self._commands: queue.SimpleQueue[CoreCommand] = queue.SimpleQueue()
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
        self._core: EngineCore[StreamSink] = EngineCore(engine, self._deliver)

    @classmethod
    def from_config(
        cls, config: EngineConfig, engine_setup: EngineSetup | None = None
    ) -> AsyncEngine:
        """Load the model described by ``config`` and start the engine thread; ``engine_setup``
        (tests: fault injection, slowed steps) is applied to the engine once built."""

        def make() -> LLMEngine:
            engine = LLMEngine(config)
            if engine_setup is not None:
                engine_setup(engine)
            return engine

        return cls(make)

    # ------------------------------------------------------------------ event loop side
    @property
    def is_running(self) -> bool:
        return self._stopped is None

    def stats(self) -> dict[str, Any]:
        """Engine counters as of the end of the latest loop iteration (see ``LLMEngine.stats``)."""
        return dict(self._core.stats)

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
        with self._lock:
            if self._stopped is not None:
                raise EngineDeadError(str(self._stopped))
            self._commands.put(SubmitGroup(requests, sink))
        return await accepted_stream(requests, sink, self.abort)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (from any thread); a no-op once the engine has stopped."""
        with self._lock:
            if self._stopped is None:
                self._commands.put(AbortRequests(list(request_ids)))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after the current step and wait for the thread to end."""
        with self._lock:
            if self._stopped is None:
                self._commands.put(StopCore())
        self._thread.join(timeout)

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
            reason = EngineDeadError(self._core.run(self._receive).reason)
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

    def _receive(self, timeout: float) -> list[CoreCommand]:
        commands: list[CoreCommand] = []
        if timeout > 0:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _deliver(self, results: list[tuple[StreamSink, object]], stats: Any) -> None:
        """Land results on their event loops (``stats()`` reads the core's own)."""
        closed = land_on_loops(results)
        if closed:
            self._core.abort_where(lambda sink: sink.loop in closed)

    def _fail_everything(self, reason: EngineDeadError) -> None:
        sinks = {id(s): s for s in self._core.owners()}
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, SubmitGroup):
                sinks[id(command.owner)] = command.owner
        try:
            self._core.abort_all()
        except Exception:  # the engine may be broken; callers must still hear
            logger.exception("aborting requests after the engine loop stopped failed")
        land_on_loops([(sink, EngineDeadError(str(reason))) for sink in sinks.values()])
