"""How long a request may still run: its own ``timeout`` and, once the server is stopping, the
drain deadline (``--shutdown-timeout``).

Every wait of a request (preparing its prompts, acceptance by the engine, each output) runs
under its ``RequestClock``; when the server starts draining, ``Drain`` moves the deadline of
every clock forward, including waits already in progress, so a request that cannot finish in
time ends cleanly (a 503, or an error event then ``[DONE]``) instead of being cut by uvicorn.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable
from typing import TypeVar

from platform_core.entrypoints.openai.errors import RequestTimeoutError, ServerShuttingDownError

T = TypeVar("T")


class RequestClock:
    """The deadlines of one request (``time.monotonic()`` seconds; ``None``: none)."""

    def __init__(self, deadline: float | None, drain_at: float | None) -> None:
        self.deadline = deadline
        self.drain_at = drain_at
        self._waiting: asyncio.Timeout | None = None

    def _when(self) -> float | None:
        ends = [t for t in (self.deadline, self.drain_at) if t is not None]
        return min(ends) if ends else None

    async def bound(self, work: Awaitable[T]) -> T:
        """Await ``work``, cancelling it when a deadline passes.

        Raises ``RequestTimeoutError`` (the request's own timeout) or ``ServerShuttingDownError``.
        """
        when = self._when()
        loop = asyncio.get_running_loop()
        timeout = asyncio.timeout_at(
            None if when is None else loop.time() + when - time.monotonic()
        )
        try:
            async with timeout:
                self._waiting = timeout
                return await work
        except TimeoutError:
            if not timeout.expired():  # raised by the work itself (e.g. DeadlineExceededError)
                raise
            if self.drain_at is not None and (
                self.deadline is None or self.drain_at <= self.deadline
            ):
                raise ServerShuttingDownError() from None
            raise RequestTimeoutError() from None
        finally:
            self._waiting = None

    def drain_by(self, drain_at: float) -> None:
        """The server stops at ``drain_at``: a wait in progress ends then at the latest."""
        self.drain_at = drain_at
        if self._waiting is not None and not self._waiting.expired():
            when = self._when()
            assert when is not None
            loop = asyncio.get_running_loop()
            self._waiting.reschedule(loop.time() + when - time.monotonic())


class Drain:
    """The server-wide shutdown deadline, handed to every live ``RequestClock``."""

    def __init__(self) -> None:
        self.drain_at: float | None = None
        self._clocks: weakref.WeakSet[RequestClock] = weakref.WeakSet()

    def clock(self, deadline: float | None) -> RequestClock:
        """A clock for a new request with its own ``deadline``."""
        clock = RequestClock(deadline, self.drain_at)
        self._clocks.add(clock)
        return clock

    def start(self, timeout: float) -> None:
        """Requests still running ``timeout`` seconds from now are ended (on the event loop)."""
        self.drain_at = time.monotonic() + timeout
        for clock in list(self._clocks):
            clock.drain_by(self.drain_at)
