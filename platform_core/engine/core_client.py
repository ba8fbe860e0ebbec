"""The front of an engine core reached over ZMQ: ``CoreClient``.

The front tokenizes on its side (``tokenizer``, its own copy), encodes each submission once and
sends it from the caller's thread; a receiving thread owns the events socket, rebuilds cumulative
outputs from the core's deltas (``OutputAssembler``) and lands each batch in the submitters'
``StreamSink``s with one ``call_soon_threadsafe`` per event loop, as ``AsyncEngine`` does. The
surface is ``AsyncEngine``'s, so the server and the data-parallel router take either.

``ProcessEngine`` (``process_engine``) is the client that starts its own core process; this
module knows nothing of processes beyond the hooks it leaves (``_prepare``, ``_watched``,
``_gone``, ``_after_stop``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from platform_core.engine.core import ACCEPTED
from platform_core.engine.core_auth import (
    ROLE_ENGINE,
    ROLE_FRONT,
    Nonces,
    check_proof,
    new_nonce,
    prove,
)
from platform_core.engine.core_messages import (
    ENCODER,
    EVENT_DECODER,
    HANDSHAKE_DECODER,
    HEARTBEAT_S,
    PEER_SILENCE_S,
    PROTOCOL_VERSION,
    Abort,
    Challenge,
    CoreBatch,
    CoreStopped,
    Detach,
    Heartbeat,
    Hello,
    Proof,
    Ready,
    Refused,
    Shutdown,
    Submit,
    error_from,
    request_to_wire,
)
from platform_core.engine.core_process import CoreAddresses
from platform_core.engine.output_assembly import OutputAssembler
from platform_core.engine.request_stream import (
    GenerateRequest,
    RequestStream,
    StreamSink,
    SubmitFront,
    accepted_stream,
    land_on_loops,
)
from platform_core.errors import EngineConnectionError, EngineDeadError

HANDSHAKE_TIMEOUT_S = 60.0  # for the core's answer to ``Hello`` (it answers once built)


@dataclass(slots=True)
class _Pending:
    """A submission waiting for the core's answer; aborted requests leave ``requests``."""

    sink: StreamSink
    requests: dict[str, GenerateRequest]


class CoreClient(SubmitFront):
    """An engine front connected to the engine core at ``addresses``.

    ``shutdown`` stops the core. ``stats()`` are the core's counters as of its latest step.
    """

    def __init__(
        self,
        addresses: CoreAddresses,
        tokenizer: Any = None,
        secret: bytes | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        stop_core_on_shutdown: bool = True,
    ) -> None:
        """Connect and say hello; raises ``EngineConnectionError`` if refused or unanswered,
        ``EngineAuthenticationError`` if the core cannot prove the secret (and whatever
        ``_prepare`` raises). Without ``stop_core_on_shutdown`` (one of several API servers
        of a core), ``shutdown`` only detaches this client."""
        self._stop_core_on_shutdown = stop_core_on_shutdown
        self.tokenizer = tokenizer
        self.error: EngineDeadError | None = None  # set when the core failed (not on shutdown)
        self.client_name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.addresses = self._addresses = addresses  # where the core listens
        self._secret = secret
        self._stopped: EngineDeadError | None = None
        self._lock = threading.Lock()  # the commands socket and the maps below
        self._submission_ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._pending_of: dict[str, int] = {}  # request id -> its pending submission
        self._sinks: dict[str, StreamSink] = {}  # accepted, unfinished request id -> sink
        self._assembler = OutputAssembler()
        self._stats: dict[str, Any] = {}
        self._context = zmq.Context()
        self._commands = self._connect(addresses.commands)
        self._events = self._connect(addresses.events)  # only the receiving thread uses it
        started: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run,
            args=(started, handshake_timeout),
            name="platform-core-core-client",
            daemon=True,
        )
        self._thread.start()
        failure = started.get()
        if failure is not None:
            self._thread.join()
            raise failure

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.client_name.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # a submit never blocks the event loop
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        return sock

    # ------------------------------------------------------------------ caller side
    @property
    def is_running(self) -> bool:
        return self._stopped is None

    def stats(self) -> dict[str, Any]:
        """The engine core's counters as of its latest step (see ``LLMEngine.stats``)."""
        return dict(self._stats)

    async def submit(
        self, requests: list[GenerateRequest], *, max_buffered_tokens: int | None = None
    ) -> RequestStream:
        """Send ``requests`` together; their stream once the core accepted them (raises its
        refusal as the same typed error). See ``SubmitFront.submit``."""
        ids = [r.request_id for r in requests]
        sink = StreamSink(asyncio.get_running_loop(), ids, self.abort, max_buffered_tokens)
        submission_id = next(self._submission_ids)
        payload = ENCODER.encode(Submit(submission_id, [request_to_wire(r) for r in requests]))
        with self._lock:
            if self._stopped is not None:
                raise EngineDeadError(str(self._stopped))
            self._pending[submission_id] = _Pending(sink, {r.request_id: r for r in requests})
            for request_id in ids:
                self._pending_of[request_id] = submission_id
            self._commands.send(payload)
        return await accepted_stream(requests, sink, self.abort)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (from any thread); a no-op once the core has stopped."""
        with self._lock:
            if self._stopped is not None:
                return
            for request_id in request_ids:
                self._sinks.pop(request_id, None)
                submission_id = self._pending_of.pop(request_id, None)
                if submission_id is not None:
                    self._pending[submission_id].requests.pop(request_id, None)
            self._assembler.forget(request_ids)
            self._commands.send(ENCODER.encode(Abort(list(request_ids))))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Ask the core to stop after its current step (requests left get ``EngineDeadError``)
        and wait up to ``timeout`` s for it to say so; or only detach (see ``__init__``)."""
        leave = Shutdown() if self._stop_core_on_shutdown else Detach()
        with self._lock:
            if self._stopped is None:
                self._commands.send(ENCODER.encode(leave))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ hooks
    def _prepare(self) -> None:
        """Run on the receiving thread before the handshake (``ProcessEngine``: start the core)."""

    def _watched(self) -> list[Any]:
        """File descriptors that become readable when the core is gone."""
        return []

    def _gone(self) -> str:
        """Why the core is gone, once a watched descriptor fired."""
        return "the engine core is gone"

    def _after_stop(self) -> None:
        """Run on the receiving thread once the core stopped (or never started)."""

    # ------------------------------------------------------------------ receiving thread
    def _run(self, started: queue.SimpleQueue[BaseException | None], timeout: float) -> None:
        try:
            self._prepare()
            self._adopt(self._handshake(timeout))
        except BaseException as exc:  # the constructor raises it
            self._close()
            self._after_stop()
            started.put(exc)
            return
        started.put(None)
        self._end(self._receive())

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._events, zmq.POLLIN)
        for fd in self._watched():
            poller.register(fd, zmq.POLLIN)
        return poller

    def _handshake(self, timeout: float) -> Ready:
        """Hello, the core's challenge (its proof checked), our proof, then ``Ready``."""
        poller = self._poller()
        deadline = time.monotonic() + timeout
        nonce = new_nonce()
        self._events.send(ENCODER.encode(Hello(PROTOCOL_VERSION, self.client_name, nonce)))
        challenge = self._answer(poller, deadline, timeout)
        if not isinstance(challenge, Challenge):
            raise EngineConnectionError(
                "the engine core answered without a challenge (another protocol version?)"
            )
        nonces = Nonces(nonce, challenge.nonce)
        core = f"the engine core at {self._addresses.events}"
        check_proof(self._secret, ROLE_ENGINE, nonces, challenge.proof, core)
        proof = None if self._secret is None else prove(self._secret, ROLE_FRONT, nonces)
        self._events.send(ENCODER.encode(Proof(proof)))
        reply = self._answer(poller, deadline, timeout)
        if not isinstance(reply, Ready):
            raise EngineConnectionError(f"{core} answered the proof with a {type(reply)}")
        if reply.protocol_version != PROTOCOL_VERSION:
            raise EngineConnectionError(
                f"the engine core speaks protocol version {reply.protocol_version}; "
                f"this client speaks version {PROTOCOL_VERSION}"
            )
        return reply

    def _answer(self, poller: zmq.Poller, deadline: float, timeout: float) -> Challenge | Ready:
        """The core's next handshake message (raises for ``Refused``, silence, garbage)."""
        while True:
            ready = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            if self._events in ready:
                break
            if ready:
                raise EngineDeadError(f"{self._gone()} before it answered")
            if time.monotonic() >= deadline:
                raise EngineConnectionError(
                    f"the engine core at {self._addresses.events} did not answer in {timeout} s"
                )
        try:
            reply = HANDSHAKE_DECODER.decode(self._events.recv())
        except msgspec.DecodeError as exc:
            raise EngineConnectionError(
                f"unreadable answer from the engine core (another protocol version?): {exc}"
            ) from None
        if isinstance(reply, Refused):
            raise EngineConnectionError(f"the engine core refused this client: {reply.reason}")
        return reply

    def _adopt(self, ready: Ready) -> None:
        self.max_model_len = ready.max_model_len
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        self.vocab_size = ready.vocab_size
        self.default_sampling = ready.default_sampling
        self.model_dir = Path(ready.model_dir)
        self._stats = ready.stats

    def _receive(self) -> CoreStopped:
        """Land the core's batches until it stops, is gone, or stays silent for
        ``PEER_SILENCE_S`` (the core heartbeats when idle); heartbeat it meanwhile."""
        poller = self._poller()
        heard = heartbeat_due = time.monotonic()
        while True:
            ready = dict(poller.poll(HEARTBEAT_S * 1000))
            now = time.monotonic()
            if now >= heartbeat_due:
                heartbeat_due = now + HEARTBEAT_S
                with self._lock:
                    self._commands.send(ENCODER.encode(Heartbeat()))
            if ready and self._events not in ready:  # only a watched descriptor: it is gone
                return CoreStopped(self._gone(), failed=True)
            if not ready:
                if now - heard > PEER_SILENCE_S:
                    return CoreStopped(
                        f"the engine core at {self._addresses.events} sent nothing for "
                        f"{PEER_SILENCE_S:.0f} s (no heartbeat): it is gone or unreachable",
                        failed=True,
                    )
                continue
            heard = now
            while True:
                try:
                    payload = self._events.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    event = EVENT_DECODER.decode(payload.buffer)
                except msgspec.DecodeError as exc:
                    return CoreStopped(f"unreadable event from the engine core: {exc}", True)
                if isinstance(event, CoreStopped):
                    return event
                self._land(event)

    def _land(self, batch: CoreBatch) -> None:
        results: list[tuple[StreamSink, object]] = []
        with self._lock:
            for submission_id in batch.accepted:
                pending = self._pending.pop(submission_id, None)
                if pending is None:
                    continue
                for request_id, request in pending.requests.items():
                    del self._pending_of[request_id]
                    self._sinks[request_id] = pending.sink
                    self._assembler.expect(request)
                results.append((pending.sink, ACCEPTED))
            for rejection in batch.rejected:
                pending = self._pending.pop(rejection.submission_id, None)
                if pending is not None:
                    for request_id in pending.requests:
                        del self._pending_of[request_id]
                    results.append((pending.sink, error_from(rejection.error)))
            step = batch.outputs
            for output in [] if step is None else self._assembler.apply(step):
                find = self._sinks.pop if output.finished else self._sinks.get
                sink = find(output.request_id, None)
                if sink is not None:
                    results.append((sink, output))
            if batch.stats is not None:
                self._stats = batch.stats
        closed = land_on_loops(results)
        if closed:  # nobody listens on those loops any more
            self.abort([rid for rid, sink in list(self._sinks.items()) if sink.loop in closed])

    def _end(self, stopped: CoreStopped) -> None:
        reason = EngineDeadError(stopped.reason)
        with self._lock:
            self._stopped = reason
            if stopped.failed:
                self.error = reason
            sinks = {id(s): s for s in self._sinks.values()}
            sinks.update((id(p.sink), p.sink) for p in self._pending.values())
            self._sinks, self._pending, self._pending_of = {}, {}, {}
            self._assembler = OutputAssembler()
            self._close()
        land_on_loops([(sink, EngineDeadError(str(reason))) for sink in sinks.values()])
        self._after_stop()

    def _close(self) -> None:
        self._commands.close()
        self._events.close()
        self._context.term()
