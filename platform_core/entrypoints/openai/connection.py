"""uvicorn's h11 protocol with a read timeout: a client must send each whole request (headers
and body) within ``read_timeout`` seconds of its first byte, or of opening the connection.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a request being
received: a connection sending nothing, half its headers, or a stalled body stayed open for
good (slowloris). The timer does not run while the app works on a request or streams its
response, however long that takes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("platform_core.server")

# States in which the client has not finished sending its request.
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


class ReadTimeoutH11Protocol(H11Protocol):
    """``H11Protocol`` closing connections that take over ``read_timeout`` s to send a request."""

    def __init__(self, *args: Any, read_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _RECEIVING:
            if self._read_timer is None:  # the first bytes of a request on a kept-alive connection
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state in _RECEIVING and not self.transport.is_closing():
            logger.info(
                "closing a connection that sent no whole request in %s s", self.read_timeout
            )
            # The app (if it started) sees a disconnect while reading the body and gives up.
            self.transport.close()
