"""``TcpTransport``: consumers pull blocks from a producer over TCP, across hosts.

The producer listens; every connection is served on its own thread, one request after another,
so fetches on different connections run concurrently. A consumer keeps its idle connections to
each producer for the next request. Block data goes from the exported tensor's memory to the
socket (``sendall``) and from the socket into the consumer's new tensor (``recv_into``): the
kernel's copies only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch

from platform_core.kv_transfer.framing import (
    PROTOCOL_VERSION,
    Reply,
    Request,
    byte_view,
    dtype_name,
    empty_host,
    recv_exact_into,
    recv_message,
    send_message,
    torch_dtype,
)
from platform_core.kv_transfer.interfaces import KVLayout
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockSource,
    BlockTransport,
    TransferError,
    UnknownTransferError,
)

logger = logging.getLogger("platform_core.kv_transfer")

Peer = tuple[str, int]
T = TypeVar("T")

_IDLE_PER_PEER = 8  # idle connections a consumer keeps to one producer
_JOIN_S = 5.0  # how long close() waits for the server's threads


def tune(sock: socket.socket) -> None:
    """Options of every transfer connection: no Nagle delay on the small control messages."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpTransport(BlockTransport):
    """Blocks over TCP. A producer listens on ``host:port`` (port 0: a free one) and tells
    consumers ``advertise_host`` (default ``host``); ``connect_timeout_s`` bounds a consumer's
    connect, ``io_timeout_s`` every wait for a peer's bytes on either side."""

    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str | None = None,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 60.0,
    ):
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.io_timeout_s = io_timeout_s
        self._server: _Server | None = None
        self._pool = _ConnectionPool(connect_timeout_s, io_timeout_s)

    # ------------------------------------------------------------------ producer
    def serve(self, source: BlockSource) -> None:
        if self._server is not None:
            raise TransferError("this transport already serves KV blocks")
        try:
            self._server = _Server(self.host, self.port, self.io_timeout_s, self._responder(source))
        except OSError as exc:
            raise TransferError(f"cannot listen on {self.host}:{self.port}: {exc}") from exc

    def address(self) -> dict[str, Any]:
        if self._server is None:
            raise TransferError("this transport serves nothing yet (call serve first)")
        return {"host": self.advertise_host or self.host, "port": self._server.port}

    def _responder(self, source: BlockSource) -> Callable[[socket.socket], Responder]:
        """What answers each connection."""
        return partial(Responder, source=source)

    # ------------------------------------------------------------------ consumer
    def fetch(
        self, address: dict[str, Any], transfer_id: str, positions: list[int], layout: KVLayout
    ) -> BlockBatch:
        request = Request("fetch", transfer_id, list(positions), layout)
        return self._call(address, request, partial(self._receive, len(positions), layout))

    def confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        self._call(address, Request("confirm", transfer_id), lambda conn, reply: None)

    def _call(
        self,
        address: dict[str, Any],
        request: Request,
        on_reply: Callable[[socket.socket, Reply], T],
    ) -> T:
        """Send ``request`` to the producer at ``address``; ``on_reply`` reads the rest of a
        successful reply. A pooled connection the producer has dropped meanwhile is replaced."""
        peer = _peer(address)
        name = f"{peer[0]}:{peer[1]}"
        while True:
            conn, reused = self._pool.take(peer)
            reply, result = None, None
            try:
                send_message(conn, request)
                reply = recv_message(conn, Reply)
                if reply is None:
                    raise ConnectionError("the producer closed the connection")
                if not reply.error:  # nothing follows an error reply
                    result = on_reply(conn, reply)
            except OSError as exc:
                conn.close()
                if reused and reply is None and not isinstance(exc, TimeoutError):
                    continue  # stale: the producer closed it while it was idle
                raise TransferError(f"KV transfer with {name} failed: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            self._pool.put(peer, conn)
            reply.raise_error(name)
            return result

    def _receive(
        self, count: int, layout: KVLayout, conn: socket.socket, reply: Reply
    ) -> BlockBatch:
        remote = reply.layout
        if remote is None or not remote.compatible(layout):
            raise TransferError(f"the producer sent blocks of another layout: {remote}")
        dtype = torch_dtype(reply.dtype)
        shape = (count, *remote.block_shape)
        if reply.num_blocks != count or reply.nbytes != math.prod(shape) * dtype.itemsize:
            raise TransferError(
                f"the producer announced {reply.num_blocks} blocks in {reply.nbytes} bytes "
                f"for {count} blocks of {remote.block_shape} {reply.dtype}"
            )
        data = self._receive_payload(conn, reply, shape, dtype)
        return BlockBatch(data, list(reply.checksums), list(reply.missing))

    def _receive_payload(
        self, conn: socket.socket, reply: Reply, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A fetch's data, announced by ``reply``: here, read from the stream into a new tensor."""
        data = empty_host(shape, dtype)
        if reply.nbytes:
            recv_exact_into(conn, byte_view(data))
        return data

    # ------------------------------------------------------------------ both
    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._pool.close()


class Responder:
    """The producer's end of one consumer connection: answers its requests in turn from
    ``source``, a fetch's data on the stream right after the reply."""

    def __init__(self, conn: socket.socket, source: BlockSource):
        self.conn = conn
        self.source = source

    def run(self) -> None:
        """Answer requests until the consumer hangs up."""
        try:
            while (request := self.next_request()) is not None:
                if request.version != PROTOCOL_VERSION:
                    error = f"protocol {request.version}, this producer speaks {PROTOCOL_VERSION}"
                    send_message(self.conn, Reply(error=error, error_kind="refused"))
                elif request.op == "fetch":
                    self.answer_fetch(request)
                elif request.op == "confirm":
                    self.answer_confirm(request.transfer_id)
                else:
                    raise ConnectionError(f"unexpected {request.op!r} request")
        finally:
            self.close()

    def next_request(self) -> Request | None:
        """The consumer's next request; None once it has hung up."""
        return recv_message(self.conn, Request)

    def answer_fetch(self, request: Request) -> None:
        layout = self.source.layout
        if request.layout is None or not layout.compatible(request.layout):
            theirs = request.layout.block_shape if request.layout else None
            error = f"blocks here are {layout.block_shape}, the consumer's {theirs}"
            send_message(self.conn, Reply(error=error, error_kind="refused", layout=layout))
            return
        count = len(request.positions)
        try:
            batch = self.source.read(request.transfer_id, request.positions)
            data = _checked(batch.data, count, layout)
        except UnknownTransferError as exc:
            send_message(self.conn, Reply(error=str(exc), error_kind="unknown"))
            return
        except Exception as exc:
            logger.exception("KV transfer %s: reading blocks failed", request.transfer_id)
            error = f"reading the blocks failed: {type(exc).__name__}: {exc}"
            send_message(self.conn, Reply(error=error, error_kind="failed"))
            return
        reply = Reply(
            layout=layout,
            dtype=dtype_name(data.dtype),
            num_blocks=count,
            nbytes=data.numel() * data.element_size(),
            checksums=list(batch.checksums),
            missing=list(batch.missing),
        )
        self.send_batch(reply, data)

    def answer_confirm(self, transfer_id: str) -> None:
        try:
            self.source.confirm(transfer_id)
        except Exception as exc:
            logger.exception("KV transfer %s: confirming failed", transfer_id)
            error = f"confirming failed: {type(exc).__name__}: {exc}"
            send_message(self.conn, Reply(error=error, error_kind="failed"))
            return
        send_message(self.conn, Reply())

    def send_batch(self, reply: Reply, data: torch.Tensor) -> None:
        """Send a fetch's ``reply`` and its ``data``."""
        send_message(self.conn, reply)
        if reply.nbytes:
            self.conn.sendall(byte_view(data))

    def close(self) -> None:
        """The connection ends: release what it holds (nothing here)."""


def _checked(data: torch.Tensor, count: int, layout: KVLayout) -> torch.Tensor:
    """``data`` as a source must return it (``count`` host blocks of ``layout``), contiguous."""
    if tuple(data.shape) != (count, *layout.block_shape) or data.device.type != "cpu":
        raise ValueError(
            f"the source returned {tuple(data.shape)} on {data.device}, "
            f"not {count} host blocks of {layout.block_shape}"
        )
    return data.contiguous()


def _peer(address: dict[str, Any]) -> Peer:
    host, port = address.get("host"), address.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        raise TransferError(f"not a TCP producer address: {address}")
    return host, port


class _ConnectionPool:
    """A consumer's connections to producers, kept open between requests."""

    def __init__(self, connect_timeout_s: float, io_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._idle: dict[Peer, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, peer: Peer) -> tuple[socket.socket, bool]:
        """An idle connection to ``peer`` (and True), or a new one (and False)."""
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop(), True
        try:
            conn = socket.create_connection(peer, timeout=self.connect_timeout_s)
        except OSError as exc:
            raise TransferError(
                f"cannot connect to KV producer {peer[0]}:{peer[1]}: {exc}"
            ) from exc
        tune(conn)
        conn.settimeout(self.io_timeout_s)
        return conn, False

    def put(self, peer: Peer, conn: socket.socket) -> None:
        """``conn`` is free for the next request to ``peer``."""
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if not self._closed and len(idle) < _IDLE_PER_PEER:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


class _Server:
    """Listens on ``host:port`` and runs ``responder(conn).run()`` for each connection on its
    own thread; ``close`` stops listening and cuts every connection."""

    def __init__(
        self,
        host: str,
        port: int,
        io_timeout_s: float,
        responder: Callable[[socket.socket], Responder],
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)  # a consumer gone between select and accept
        self.port: int = self._listener.getsockname()[1]
        self._io_timeout_s = io_timeout_s
        self._responder = responder
        self._wake_read, self._wake_write = socket.socketpair()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kv-accept-{self.port}", daemon=True
        )
        self._acceptor.start()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj is self._wake_read for key, _ in ready):
                    return
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    continue
                tune(conn)
                conn.settimeout(self._io_timeout_s)
                thread = threading.Thread(
                    target=self._run, args=(conn,), name=f"kv-serve-{self.port}", daemon=True
                )
                with self._lock:
                    if self._closed:
                        conn.close()
                        return
                    self._connections[conn] = thread
                thread.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._responder(conn).run()
        except OSError as exc:  # the consumer went away or stalled past the timeout
            logger.debug("KV transfer connection ended: %s", exc)
        except Exception:
            logger.exception("KV transfer connection failed")
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._connections.values())
            for conn in self._connections:
                with contextlib.suppress(OSError):  # wakes its thread out of recv
                    conn.shutdown(socket.SHUT_RDWR)
        self._wake_write.send(b"\0")
        deadline = time.monotonic() + _JOIN_S
        for thread in [self._acceptor, *threads]:
            thread.join(max(0.0, deadline - time.monotonic()))
        for sock in (self._listener, self._wake_read, self._wake_write):
            sock.close()
