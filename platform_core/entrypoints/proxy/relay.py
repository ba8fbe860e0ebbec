"""Passing an upstream's answer on to the client unchanged: whole, or as it arrives."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from platform_core.entrypoints.proxy.metrics import Outcome, outcome_of
from platform_core.entrypoints.proxy.upstream import describe

logger = logging.getLogger("platform_core.proxy")

# Headers of one connection, or that the proxy's own server writes (it frames the body anew).
_NOT_RELAYED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)


def relayed_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The headers of an upstream's answer that the client gets too."""
    return [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers.multi_items()
        if name not in _NOT_RELAYED
    ]


def passthrough(response: httpx.Response) -> Response:
    """An upstream's answer, already read, as the client's: same status, headers and body."""
    relayed = Response(response.content, status_code=response.status_code)
    relayed.raw_headers = [*relayed_headers(response), *relayed.raw_headers]
    return relayed


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """An upstream's streamed answer passed on as its bytes arrive (status, headers and body
    unchanged), server-sent events and whole JSON bodies alike.

    The upstream answer is closed as soon as the client disconnects, so the upstream server
    sees the disconnect and aborts the request (freeing its KV blocks); also when the body
    ends, or when reading it fails (the client's answer is then cut: its connection is
    dropped). ``on_first_byte`` runs when the first body bytes arrive, ``on_end`` once with
    the outcome.
    """

    def __init__(
        self,
        upstream: httpx.Response,
        on_first_byte: Callable[[], None],
        on_end: Callable[[Outcome], None],
    ) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.raw_headers = relayed_headers(upstream)
        self.background = None
        self._on_first_byte = on_first_byte
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        outcome: Outcome = "disconnected"
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if relay.done():
                outcome = relay.result()
        finally:
            relay.cancel()
            gone.cancel()
            self._on_end(outcome)
            await self.upstream.aclose()

    async def _relay(self, send: Send) -> Outcome:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        first = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self._on_first_byte()
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            logger.warning("%s broke off its answer: %s", self.upstream.url, describe(exc))
            return "upstream_error"
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return outcome_of(self.status_code)
