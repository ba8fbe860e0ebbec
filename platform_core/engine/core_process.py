"""The engine core as a process: the ``EngineCore`` loop behind ZMQ sockets (``CoreServer``).

The core binds two ROUTER sockets and serves any number of clients, each known by its ZMQ
routing id: clients send commands to the *commands* socket and read results from the *events*
socket, where they also say ``Hello`` first (the reply goes back on the socket the client is
known to be connected to). Commands from a client that has not been greeted are dropped; with a
shared secret, a ``Hello`` without it is refused. Traffic is not encrypted: over ``tcp://`` keep
the core on a trusted network.

The loop busy-polls: between steps it drains commands without blocking; idle, it blocks in the
poll (with the idle health check of ``EngineCore``). The poll also watches a pipe from the
process that started the core: when that process is gone, however it died, the pipe reads as
closed and the core stops. ``PR_SET_PDEATHSIG`` covers a core stuck in a step.

Detokenization and stop strings stay in the core. They decide when a request ends, so in the
core a stop string ends its request in the step that produced it; detokenizing in the front (as
vLLM does) would see it a step late and generate (and pay for) one token too many per stop, and
the front would need the core's held-back text rules too. Measured with
``benchmarks/engine_transport.py`` (SmolLM2-135M's 49k-token tokenizer, 256 running requests, a
stop string each, 2 shared CPU cores): detokenizing costs 3.0-3.4 ms per step and stop checks
0.4 ms, 0.2-0.3% of that CPU step (1.25-1.43 s). Beside a GPU step of 10-20 ms, at this CPU's
speed, it would be 17-34%: the figure to measure on accelerator hosts, and the reason to move it
to the front (accepting the late stop) if a profile there says so.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from platform_core.engine.core import (
    ACCEPTED,
    AbortRequests,
    CoreCommand,
    EngineCore,
    StopCore,
    SubmitGroup,
)
from platform_core.engine.core_messages import (
    COMMAND_DECODER,
    ENCODER,
    HELLO_DECODER,
    PROTOCOL_VERSION,
    Abort,
    CoreBatch,
    CoreStopped,
    Ready,
    Refused,
    Rejection,
    Shutdown,
    error_info,
    request_from_wire,
)
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.output_deltas import DeltaWriter
from platform_core.engine.request_stream import GenerateRequest

logger = logging.getLogger("platform_core.engine")


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    """Where an engine core listens (ZMQ endpoints, ``ipc://PATH`` or ``tcp://HOST:PORT``)."""

    commands: str
    events: str

    @classmethod
    def ipc_in(cls, directory: str) -> CoreAddresses:
        """Unix sockets in ``directory`` (a private one: its permissions guard them)."""
        return cls(f"ipc://{directory}/commands", f"ipc://{directory}/events")


@dataclass(slots=True)
class _Submission:
    """The owner of a submission's results in the ``EngineCore``."""

    client: bytes
    submission_id: int
    requests: list[GenerateRequest]


@dataclass(slots=True)
class _Client:
    name: str
    writer: DeltaWriter = field(default_factory=DeltaWriter)


def _batch() -> CoreBatch:
    return CoreBatch([], [], [], None)


class CoreServer:
    """The sockets of an engine core, and the receive and deliver ends of its loop."""

    def __init__(
        self, addresses: CoreAddresses, secret: str | None, parent_fd: int | None = None
    ) -> None:
        """Bind ``addresses``; with ``parent_fd``, stop once that pipe reads as closed."""
        self._secret = secret
        self._context = zmq.Context()
        self._commands = self._bind(addresses.commands)
        self._events = self._bind(addresses.events)
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._poller.register(self._events, zmq.POLLIN)
        self._parent_fd = parent_fd
        if parent_fd is not None:
            self._poller.register(parent_fd, zmq.POLLIN)
        self._clients: dict[bytes, _Client] = {}
        self._ready: Ready | None = None
        self._stats_sent: dict[str, Any] | None = None

    def _bind(self, address: str) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a client's events: deltas build on each other
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.bind(address)
        except zmq.ZMQError:
            sock.close(0)
            self._context.term()
            raise
        return sock

    def serve(self, engine: LLMEngine) -> None:
        """Run the loop over ``engine`` until told to stop or it fails; tell every client why
        it ended, stop the engine's workers and close the sockets."""
        self._ready = Ready(
            PROTOCOL_VERSION,
            engine.max_model_len,
            sorted(engine.eos_token_ids),
            engine.vocab_size,
            dict(engine.default_sampling),
            str(engine.model_dir),
            engine.stats(),
        )
        core: EngineCore[_Submission] = EngineCore(engine, self.deliver)
        try:
            stopped = CoreStopped(core.run(self.receive).reason, failed=False)
        except BaseException as exc:  # any failure ends the loop the same way
            logger.exception("the engine loop failed; failing every request")
            stopped = CoreStopped(f"the engine loop failed: {exc!r}", failed=True)
        for identity in self._clients:
            self._send(identity, stopped)
        try:
            core.abort_all()
        except Exception:  # the engine may be broken; stopping goes on
            logger.exception("aborting requests after the engine loop stopped failed")
        try:
            engine.shutdown()  # worker processes, if the executor has any
        except Exception:  # stopping must not fail; the reason is logged
            logger.exception("stopping the engine's executor failed")
        self.close()

    def close(self) -> None:
        self._commands.close()
        self._events.close()
        self._context.term()

    # ------------------------------------------------------------------ receiving
    def receive(self, timeout: float) -> list[CoreCommand]:
        """The commands that arrived (waiting up to ``timeout`` s); greets new clients."""
        ready = dict(self._poller.poll(timeout * 1000 if timeout > 0 else 0))
        if self._parent_fd is not None and self._parent_fd in ready:
            return [StopCore("the process that started the engine core is gone")]
        if self._events in ready:
            self._greet()
        commands: list[CoreCommand] = []
        if self._commands in ready:
            while True:
                try:
                    identity, payload = self._commands.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                commands += self._command(identity.bytes, payload.buffer)
        return commands

    def _greet(self) -> None:
        while True:
            try:
                identity, payload = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._handshake(identity, payload)
            self._send(identity, reply)

    def _handshake(self, identity: bytes, payload: bytes) -> Ready | Refused:
        try:
            hello = HELLO_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            return Refused(f"not a platform-core hello ({exc})")
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"client {hello.client_name!r} speaks protocol version {hello.protocol_version}; "
                f"this engine core speaks version {PROTOCOL_VERSION}"
            )
            logger.warning("refused a client: %s", reason)
            return Refused(reason)
        if self._secret is not None and not hmac.compare_digest(
            (hello.secret or "").encode(), self._secret.encode()
        ):
            logger.warning("refused client %r: wrong shared secret", hello.client_name)
            return Refused("wrong or missing shared secret")
        assert self._ready is not None
        self._clients[identity] = _Client(hello.client_name)
        logger.info("engine core: client %r connected", hello.client_name)
        return self._ready

    def _command(self, identity: bytes, payload: memoryview) -> list[CoreCommand]:
        client = self._clients.get(identity)
        if client is None:
            logger.warning("dropped a command from a client that did not say hello")
            return []
        try:
            message = COMMAND_DECODER.decode(payload)
        except msgspec.DecodeError:
            logger.exception("dropped an undecodable command from %r", client.name)
            return []
        if isinstance(message, Abort):
            client.writer.forget(message.request_ids)
            return [AbortRequests(message.request_ids)]
        if isinstance(message, Shutdown):
            return [StopCore()]
        try:
            requests = [request_from_wire(wire) for wire in message.requests]
        except Exception as exc:  # invalid sampling params: the submission is refused
            batch = _batch()
            batch.rejected.append(Rejection(message.submission_id, error_info(exc)))
            self._send(identity, batch)
            return []
        return [SubmitGroup(requests, _Submission(identity, message.submission_id, requests))]

    # ------------------------------------------------------------------ delivering
    def deliver(self, results: list[tuple[_Submission, object]], stats: Any) -> None:
        """One ``CoreBatch`` per client with results, and to every client when the stats
        changed."""
        batches: dict[bytes, CoreBatch] = {}
        for owner, item in results:
            batch = batches.get(owner.client)
            if batch is None:
                batch = batches[owner.client] = _batch()
            writer = self._clients[owner.client].writer
            if item is ACCEPTED:
                batch.accepted.append(owner.submission_id)
                for request in owner.requests:
                    writer.expect(request)
                owner.requests = []
            elif isinstance(item, BaseException):
                batch.rejected.append(Rejection(owner.submission_id, error_info(item)))
            else:
                batch.outputs.append(writer.delta(item))  # type: ignore[arg-type]
        if stats is not None and stats != self._stats_sent:
            self._stats_sent = stats
            for identity in self._clients:
                batch = batches.get(identity)
                if batch is None:
                    batch = batches[identity] = _batch()
                batch.stats = stats
        for identity, batch in batches.items():
            self._send(identity, batch)

    def _send(self, identity: bytes, message: Any) -> None:
        self._events.send_multipart([identity, ENCODER.encode(message)], copy=False)
