"""``ShmTransport``: instances on one host; requests and replies over TCP (``TcpTransport``'s
protocol), block data through POSIX shared memory instead of the socket.

Each consumer connection has a segment on the producer's side, made for its first fetch and
reused by the next ones (a new segment's pages cost more than the copy into them). A fetch's
reply names it; the producer copies the blocks in chunk by chunk, saying on the socket how far
it got, while the consumer maps the segment and copies each chunk out into its own tensor; the
consumer then sends ``release``. The producer unlinks the segment when the connection ends (the
consumer hung up or died), when the consumer stays silent past ``io_timeout_s`` in a fetch or
past ``keep_segment_s`` between fetches, when a fetch needs a bigger one, and on ``close``. The
producer's resource tracker unlinks what is left if the producer itself dies.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

from platform_core.kv_transfer.framing import (
    Reply,
    Request,
    empty_host,
    recv_exact_into,
    recv_message,
    send_message,
)
from platform_core.kv_transfer.tcp_transport import Responder, TcpTransport
from platform_core.kv_transfer.transport import BlockSource, TransferError

SEGMENT_PREFIX = "pckv_"  # every segment's name starts so (/dev/shm/pckv_*)
CHUNK_BYTES = 8 << 20  # the producer copies, and reports, this much at a time
_READY = struct.Struct("!Q")  # producer to consumer: bytes of the segment ready so far
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once, not one fault each


class ShmTransport(TcpTransport):
    """Blocks through shared memory between instances on one host. The producer listens on
    ``host:port`` (port 0: a free one) for requests; timeouts as ``TcpTransport``'s, and
    ``keep_segment_s``: how long a connection keeps its segment between fetches."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 60.0,
        keep_segment_s: float = 2.0,
    ):
        super().__init__(host, port, None, connect_timeout_s, io_timeout_s)
        self.keep_segment_s = keep_segment_s
        self._segments = _Segments()

    def _responder(self, source: BlockSource) -> Callable[[socket.socket], Responder]:
        return partial(
            SegmentResponder,
            source=source,
            segments=self._segments,
            io_timeout_s=self.io_timeout_s,
            keep_segment_s=self.keep_segment_s,
        )

    def _receive_payload(
        self, conn: socket.socket, reply: Reply, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Copy the blocks out of the segment the reply names as they become ready, then
        release the segment."""
        data = empty_host(shape, dtype)
        if not reply.nbytes:
            return data
        if not reply.segment.startswith(SEGMENT_PREFIX):
            raise TransferError(f"not a KV segment: {reply.segment!r}")
        try:
            segment = map_segment(reply.segment)
        except FileNotFoundError as exc:
            raise TransferError(
                f"no shared-memory segment {reply.segment}: is the producer on another host?"
            ) from exc
        if segment.numel() < reply.nbytes:
            raise TransferError(f"segment {reply.segment} is smaller than announced")
        target = data.view(-1).view(torch.uint8)
        copied, ready = 0, bytearray(_READY.size)
        while copied < reply.nbytes:
            recv_exact_into(conn, memoryview(ready))
            (upto,) = _READY.unpack(ready)
            if not copied < upto <= reply.nbytes:
                raise TransferError(f"the producer reported {upto} of {reply.nbytes} bytes ready")
            _copy(target[copied:upto], segment[copied:upto])
            copied = upto
        send_message(conn, Request("release"))
        return data

    def close(self) -> None:
        super().close()
        self._segments.unlink_all()  # those of threads that did not end in time


class SegmentResponder(Responder):
    """The producer's end of one consumer connection of a ``ShmTransport``: a fetch's data
    goes through the connection's segment."""

    def __init__(
        self,
        conn: socket.socket,
        source: BlockSource,
        segments: _Segments,
        io_timeout_s: float,
        keep_segment_s: float,
    ):
        super().__init__(conn, source)
        self.segments = segments
        self.io_timeout_s = io_timeout_s
        self.keep_segment_s = keep_segment_s
        self.segment: _Segment | None = None

    def next_request(self) -> Request | None:
        if self.segment is not None and not self._readable_within(self.keep_segment_s):
            self._drop_segment()
        return super().next_request()

    def send_batch(self, reply: Reply, data: torch.Tensor) -> None:
        if not reply.nbytes:
            super().send_batch(reply, data)
            return
        try:
            segment = self._segment_for(reply.nbytes)
        except OSError as exc:
            error = f"no shared memory for {reply.nbytes} bytes: {exc}"
            send_message(self.conn, Reply(error=error, error_kind="failed"))
            return
        reply.segment = segment.name
        send_message(self.conn, reply)
        source = data.view(-1).view(torch.uint8)
        for start in range(0, reply.nbytes, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, reply.nbytes)
            _copy(segment.view[start:end], source[start:end])
            self.conn.sendall(_READY.pack(end))
        done = recv_message(self.conn, Request)
        if done is None or done.op != "release":
            raise ConnectionError(f"the consumer did not release segment {segment.name}")

    def close(self) -> None:
        self._drop_segment()

    def _segment_for(self, nbytes: int) -> _Segment:
        """The connection's segment, replaced by a new one if gone or too small."""
        if self.segment is not None and (
            self.segment.unlinked or self.segment.view.numel() < nbytes
        ):
            self._drop_segment()
        if self.segment is None:
            self.segment = self.segments.create(nbytes)
        return self.segment

    def _drop_segment(self) -> None:
        if self.segment is not None:
            self.segments.unlink(self.segment)
            self.segment = None  # the mapping goes with the last view of it

    def _readable_within(self, seconds: float) -> bool:
        """Whether the consumer sends something (or hangs up) within ``seconds``."""
        self.conn.settimeout(seconds)
        try:
            self.conn.recv(1, socket.MSG_PEEK)
            return True
        except TimeoutError:
            return False
        finally:
            self.conn.settimeout(self.io_timeout_s)


@dataclass
class _Segment:
    name: str
    shm: SharedMemory  # closed at once: kept to unlink the name (and untrack it)
    view: torch.Tensor  # uint8, the whole mapping
    unlinked: bool = False


class _Segments:
    """A producer's live segments."""

    def __init__(self) -> None:
        self._live: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    def create(self, nbytes: int) -> _Segment:
        """A new segment of ``nbytes``, its pages taken (``OSError`` when shared memory is
        short: writing past a full ``/dev/shm`` would raise SIGBUS instead)."""
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        # SharedMemory registers the name with the resource tracker (unlinked if this
        # process dies); the tensor below is the mapping used.
        shm = SharedMemory(name=name, create=True, size=nbytes)
        shm.close()
        try:
            view = map_segment(name, reserve=nbytes)
        except OSError:
            shm.unlink()
            raise
        segment = _Segment(name, shm, view)
        with self._lock:
            self._live[name] = segment
        return segment

    def unlink(self, segment: _Segment) -> None:
        """Remove ``segment``'s name (once); mappings stay valid while their views live."""
        with self._lock:
            if segment.unlinked:
                return
            segment.unlinked = True
            del self._live[segment.name]
            segment.shm.unlink()

    def unlink_all(self) -> None:
        with self._lock:
            segments = list(self._live.values())
        for segment in segments:
            self.unlink(segment)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[:] = source`` (uint8) on this thread alone, without the GIL: a torch copy would
    start a team of intra-op threads beside the engine's own, which already use every core."""
    np.copyto(target.numpy(), source.numpy())


def map_segment(name: str, reserve: int = 0) -> torch.Tensor:
    """Segment ``name`` as a uint8 tensor over its mapping, which lasts as long as the tensor
    or a view of it does (nothing to close). ``reserve``: allocate that many bytes of it first.

    Not ``SharedMemory(name)``: before Python 3.13 (``track=False``) that registers the segment
    with this process's resource tracker, which unlinks it, warning of a leak, when this process
    exits, though the producer owns it; and it cannot map every page at once (``MAP_POPULATE``).
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        if reserve and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, reserve)
        mapping = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
