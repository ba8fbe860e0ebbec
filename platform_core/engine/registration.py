"""Engine cores on other hosts: a headless host registers its cores with the front.

``serve --headless`` connects to the front's registration port (plain TCP, length-prefixed
msgpack), and both prove the shared secret (``core_auth``: the front first, so an engine never
serves a front that cannot). The engine host then starts its cores bound to the local address
of that connection (an address the front reaches it by) and registers their addresses; the
front's API servers connect to them as to local cores, with the same handshake. The connection
stays open: the engine host sends a beat every ``HEARTBEAT_S``; a host silent for
``PEER_SILENCE_S`` or whose connection closes counts as dead (``RegistrationServer.lost``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import selectors
import signal
import socket
import struct
import threading
import time

import msgspec

from platform_core.config import EngineConfig
from platform_core.engine.core_auth import (
    ROLE_ENGINE,
    ROLE_FRONT,
    EngineAuthenticationError,
    Nonces,
    check_proof,
    new_nonce,
    prove,
)
from platform_core.engine.core_messages import HEARTBEAT_S, PEER_SILENCE_S
from platform_core.engine.core_process import CoreAddresses
from platform_core.errors import ConfigError, EngineConnectionError, EngineDeadError

logger = logging.getLogger("platform_core.engine")

_MAX_FRAME = 1 << 20


class EngineHello(msgspec.Struct, tag="engine-hello"):
    nonce: bytes


class FrontChallenge(msgspec.Struct, tag="front-challenge"):
    nonce: bytes
    proof: bytes


class Register(msgspec.Struct, tag="register"):
    proof: bytes
    cores: list[tuple[str, str]]  # (commands, events) per core


class Registered(msgspec.Struct, tag="registered"):
    pass


class Beat(msgspec.Struct, tag="beat"):
    pass


class RegistrationRefused(msgspec.Struct, tag="refused"):
    reason: str


_Message = EngineHello | FrontChallenge | Register | Registered | Beat | RegistrationRefused
_DECODER = msgspec.msgpack.Decoder(_Message)
_ENCODER = msgspec.msgpack.Encoder()


def _send(sock: socket.socket, message: object) -> None:
    payload = _ENCODER.encode(message)
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv(sock: socket.socket) -> object:
    header = _recv_exactly(sock, 4)
    (size,) = struct.unpack("<I", header)
    if size > _MAX_FRAME:
        raise EngineConnectionError(f"a {size}-byte registration frame is too large")
    return _DECODER.decode(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise EngineConnectionError("the peer closed the registration connection")
        data += part
    return data


class RegistrationServer:
    """The front's end: takes registrations, then watches each engine host's beats."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._secret = secret
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._hosts: list[tuple[socket.socket, str]] = []
        self.lost: list[str] = []  # why each lost engine host counts as dead
        self._closed = threading.Event()

    def wait_for(self, count: int, timeout: float) -> list[CoreAddresses]:
        """Accept registrations until ``count`` cores registered; ``EngineConnectionError``
        after ``timeout`` s. Refused hosts (wrong secret) are logged and do not count."""
        deadline = time.monotonic() + timeout
        cores: list[CoreAddresses] = []
        while len(cores) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineConnectionError(
                    f"{len(cores)} of {count} remote engine cores registered within {timeout} s "
                    "(are the headless hosts started with the same secret and this address?)"
                )
            self._listener.settimeout(left)
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            try:
                cores += self._admit(sock, f"engine host {peer[0]}:{peer[1]}", left)
            except (EngineConnectionError, OSError, msgspec.DecodeError) as exc:
                logger.warning("refused an engine host: %s", exc)
                sock.close()
        threading.Thread(target=self._watch, name="platform-core-registry", daemon=True).start()
        return cores[:count]

    def _admit(self, sock: socket.socket, peer: str, timeout: float) -> list[CoreAddresses]:
        """Both proofs, then the host's cores (it registers once they are built)."""
        sock.settimeout(timeout)
        hello = _recv(sock)
        if not isinstance(hello, EngineHello):
            raise EngineConnectionError(f"{peer} did not say hello")
        nonces = Nonces(new_nonce(), hello.nonce)
        _send(sock, FrontChallenge(nonces.front, prove(self._secret, ROLE_FRONT, nonces)))
        register = _recv(sock)
        if not isinstance(register, Register):
            raise EngineConnectionError(f"{peer} did not register")
        try:
            check_proof(self._secret, ROLE_ENGINE, nonces, register.proof, peer)
        except EngineAuthenticationError as exc:
            _send(sock, RegistrationRefused(str(exc)))
            raise
        _send(sock, Registered())
        self._hosts.append((sock, peer))
        logger.info("%s registered %d engine cores", peer, len(register.cores))
        return [CoreAddresses(commands, events) for commands, events in register.cores]

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        heard = {}
        for sock, peer in self._hosts:
            sock.setblocking(True)
            selector.register(sock, selectors.EVENT_READ, peer)
            heard[peer] = time.monotonic()
        while not self._closed.is_set() and not self.lost:
            for key, _ in selector.select(HEARTBEAT_S):
                try:
                    _recv(key.fileobj)
                    heard[key.data] = time.monotonic()
                except (EngineConnectionError, OSError, msgspec.DecodeError) as exc:
                    self.lost.append(f"{key.data}: {exc}")
            now = time.monotonic()
            self.lost += [
                f"{peer} sent no beat for {PEER_SILENCE_S:.0f} s"
                for peer, at in heard.items()
                if now - at > PEER_SILENCE_S
            ]

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for sock, _ in self._hosts:
            sock.close()


def _connect_when_listening(front: tuple[str, int], timeout: float) -> socket.socket:
    """Connect to the front, retrying while it refuses (it may start after this host) for up
    to ``timeout`` s; ``EngineConnectionError`` after that."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(front, timeout=max(0.1, deadline - time.monotonic()))
        except ConnectionRefusedError as exc:
            if time.monotonic() >= deadline:
                raise EngineConnectionError(
                    f"no front listened at {front[0]}:{front[1]} within {timeout} s"
                ) from exc
            time.sleep(0.2)


def run_headless(args: argparse.Namespace, config: EngineConfig, secret: bytes | None) -> None:
    """``serve --headless``: start ``data_parallel_size`` cores, register them, beat until
    SIGINT/SIGTERM. Raises ``EngineDeadError`` when a core dies, ``EngineConnectionError``
    when the front refuses this host or goes away."""
    from platform_core.distributed.launch import find_free_port
    from platform_core.engine.process_engine import ProcessEngine

    if secret is None or args.data_parallel_address is None:
        raise ConfigError(
            "--headless needs --data-parallel-address and a shared secret "
            "(--engine-secret-file or $PLATFORM_CORE_ENGINE_SECRET)"
        )
    front = (args.data_parallel_address, args.data_parallel_rpc_port)
    sock = _connect_when_listening(front, args.remote_engine_timeout)
    local_host = sock.getsockname()[0]  # where the front reaches this host
    nonces_engine = new_nonce()
    _send(sock, EngineHello(nonces_engine))
    challenge = _recv(sock)
    if not isinstance(challenge, FrontChallenge):
        raise EngineConnectionError(f"the front at {front} did not answer with a challenge")
    nonces = Nonces(challenge.nonce, nonces_engine)
    check_proof(secret, ROLE_FRONT, nonces, challenge.proof, f"the front at {front}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cores: list[ProcessEngine] = []
    try:
        single = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1)
        )
        for _ in range(config.parallel.data_parallel_size):
            ports = [find_free_port() for _ in range(2)]
            addresses = CoreAddresses(*(f"tcp://{local_host}:{port}" for port in ports))
            cores.append(ProcessEngine(single, addresses=addresses, secret=secret))
        cores_wire = [(c.addresses.commands, c.addresses.events) for c in cores]
        _send(sock, Register(prove(secret, ROLE_ENGINE, nonces), cores_wire))
        answer = _recv(sock)
        if not isinstance(answer, Registered):
            raise EngineConnectionError(f"the front refused this host: {answer}")
        logger.info("registered %d engine cores with the front at %s", len(cores), front)
        while not stop.wait(HEARTBEAT_S):
            dead = next((core for core in cores if not core.is_running), None)
            if dead is not None:
                raise EngineDeadError(f"an engine core stopped: {dead.error}")
            try:
                _send(sock, Beat())
            except OSError as exc:
                raise EngineConnectionError(f"the front at {front} is gone: {exc}") from None
    finally:
        sock.close()
        for core in cores:
            core.shutdown()
