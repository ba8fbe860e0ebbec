"""The engine core as a process: the ``EngineCore`` loop behind ZMQ sockets (``CoreServer``).

The core binds two ROUTER sockets and serves any number of clients, each known by its ZMQ
routing id: clients send commands to the *commands* socket and read results from the *events*
socket, where they also say ``Hello`` first (the reply goes back on the socket the client is
known to be connected to), then proves the shared secret (``core_auth``; the core proves it too).
Commands from a client that has not been admitted are dropped; with a shared secret, a client
without the proof is refused. Traffic is not encrypted: over ``tcp://`` keep the core on a
trusted network. Both sides heartbeat (``HEARTBEAT_S``; the core from a thread of its own): a
client silent for ``PEER_SILENCE_S`` (its process died) is dropped and its requests aborted,
freeing their blocks.

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

import logging
import threading
import time
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
from platform_core.engine.core_auth import (
    ROLE_ENGINE,
    ROLE_FRONT,
    EngineAuthenticationError,
    Nonces,
    check_proof,
    new_nonce,
    prove,
)
from platform_core.engine.core_messages import (
    COMMAND_DECODER,
    ENCODER,
    HEARTBEAT_S,
    HELLO_DECODER,
    PEER_SILENCE_S,
    PROTOCOL_VERSION,
    Abort,
    Challenge,
    CoreBatch,
    CoreStopped,
    Detach,
    Heartbeat,
    Proof,
    Ready,
    Refused,
    Rejection,
    Shutdown,
    error_info,
    request_from_wire,
)
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.output_deltas import DeltaWriter
from platform_core.engine.outputs import RequestOutput
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
    last_seen: float  # monotonic time of its latest command
    writer: DeltaWriter = field(default_factory=DeltaWriter)


def _batch() -> CoreBatch:
    return CoreBatch([], [], None, None)


class CoreServer:
    """The sockets of an engine core, and the receive and deliver ends of its loop."""

    def __init__(
        self, addresses: CoreAddresses, secret: bytes | None, parent_fd: int | None = None
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
        self._greeting: dict[bytes, tuple[str, Nonces]] = {}  # said hello, not yet proved
        # The events socket is shared with the heartbeat thread (``_beat``); ZMQ sockets are not.
        self._events_lock = threading.Lock()
        self._stop_beating = threading.Event()
        self._beater = threading.Thread(target=self._beat, name="core-heartbeat", daemon=True)
        self._core: EngineCore[_Submission] | None = None
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
        self._core = core = EngineCore(engine, self.deliver)
        self._beater.start()
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
        self._stop_beating.set()
        if self._beater.is_alive():
            self._beater.join()
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
        self._keep_alive()
        return commands

    def _keep_alive(self) -> None:
        """Drop the silent clients and abort their requests (their process died, or the network
        between us did). Runs after the commands were drained, so what a client sent during a
        long step counts."""
        now = time.monotonic()
        silent = [i for i, c in self._clients.items() if now - c.last_seen > PEER_SILENCE_S]
        for identity in silent:
            self._drop(identity, f"silent for {PEER_SILENCE_S:.0f} s")

    def _beat(self) -> None:
        """Heartbeat every admitted client from a thread of its own, so that a step longer than
        ``PEER_SILENCE_S`` (a long prefill on a slow CPU) does not read as a dead core; torch
        releases the GIL in its kernels. A core whose loop hangs keeps beating: death of the
        process or of the host is what the beats tell."""
        beat = ENCODER.encode(_batch())
        while not self._stop_beating.wait(HEARTBEAT_S):
            for identity in list(self._clients):
                with self._events_lock:
                    self._events.send_multipart([identity, beat], copy=False)

    def _greet(self) -> None:
        while True:
            try:
                with self._events_lock:
                    identity, payload = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._handshake(identity, payload)
            self._send(identity, reply)

    def _drop(self, identity: bytes, why: str) -> None:
        """Forget a client and abort its requests (their blocks go back to the pool)."""
        client = self._clients.pop(identity)
        logger.warning("engine core: client %r %s; aborting its requests", client.name, why)
        if self._core is not None:
            self._core.abort_where(lambda owner: owner.client == identity)

    def _handshake(self, identity: bytes, payload: bytes) -> Challenge | Ready | Refused:
        """A ``Hello`` gets a ``Challenge``; the ``Proof`` that follows, ``Ready`` or
        ``Refused``."""
        try:
            message = HELLO_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            return Refused(f"not a platform-core hello ({exc})")
        if isinstance(message, Proof):
            return self._admit(identity, message)
        if message.protocol_version != PROTOCOL_VERSION:
            reason = (
                f"client {message.client_name!r} speaks protocol version "
                f"{message.protocol_version}; this engine core speaks version {PROTOCOL_VERSION}"
            )
            logger.warning("refused a client: %s", reason)
            return Refused(reason)
        nonces = Nonces(message.nonce, new_nonce())
        self._greeting[identity] = (message.client_name, nonces)
        proof = None if self._secret is None else prove(self._secret, ROLE_ENGINE, nonces)
        return Challenge(nonces.engine, proof)

    def _admit(self, identity: bytes, message: Proof) -> Ready | Refused:
        greeting = self._greeting.pop(identity, None)
        if greeting is None:
            return Refused("a proof without a hello")
        name, nonces = greeting
        try:
            check_proof(self._secret, ROLE_FRONT, nonces, message.proof, f"client {name!r}")
        except EngineAuthenticationError as exc:
            logger.warning("refused a client: %s", exc)
            return Refused(str(exc))
        assert self._ready is not None
        self._clients[identity] = _Client(name, time.monotonic())
        logger.info("engine core: client %r connected", name)
        return self._ready

    def _command(self, identity: bytes, payload: memoryview) -> list[CoreCommand]:
        client = self._clients.get(identity)
        if client is None:
            logger.warning("dropped a command from a client that did not say hello")
            return []
        client.last_seen = time.monotonic()
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
        if isinstance(message, Heartbeat):
            return []
        if isinstance(message, Detach):
            self._drop(identity, "detached")
            self._send(identity, CoreStopped("this client detached", failed=False))
            return []
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
        outputs: dict[bytes, list[RequestOutput]] = {}
        for owner, item in results:
            client = self._clients.get(owner.client)
            if client is None:
                continue  # dropped as silent; its requests were aborted
            batch = batches.get(owner.client)
            if batch is None:
                batch = batches[owner.client] = _batch()
            if item is ACCEPTED:
                batch.accepted.append(owner.submission_id)
                for request in owner.requests:
                    client.writer.expect(request)
                owner.requests = []
            elif isinstance(item, BaseException):
                batch.rejected.append(Rejection(owner.submission_id, error_info(item)))
            else:
                outputs.setdefault(owner.client, []).append(item)  # type: ignore[arg-type]
        for identity, items in outputs.items():
            batches[identity].outputs = self._clients[identity].writer.write(items)
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
        payload = ENCODER.encode(message)
        with self._events_lock:
            self._events.send_multipart([identity, payload], copy=False)
