"""Request bodies decoded without stalling the event loop.

The C JSON decoder holds the GIL for a whole body: 8 MB of integers (a million token ids) took
120 ms, during which no other request, stream or ``/health`` moved. Bodies up to
``INLINE_BODY_BYTES`` are decoded inline as before (a few ms at most); larger ones are decoded on
a worker thread by the pure-Python decoder, which gives the GIL back every switch interval, so the
event loop keeps running while they decode (at about 2 s per million values for that request).
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

INLINE_BODY_BYTES = 256 << 10


def _yielding_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


_DECODER = _yielding_decoder()


def decode_body(body: bytes) -> Any:
    """``json.loads(body)`` that runs Python bytecode per value, so other threads keep running."""
    return _DECODER.decode(body.decode("utf-8"))


class OffLoopJsonRequest(Request):
    """A request whose large JSON body is decoded on a worker thread."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                if len(body) <= INLINE_BODY_BYTES:
                    self._json = json.loads(body)
                else:
                    self._json = await asyncio.to_thread(decode_body, body)
            except UnicodeDecodeError as exc:  # FastAPI answers JSON errors as 400s naming them
                raise json.JSONDecodeError(f"invalid UTF-8 ({exc.reason})", "", exc.start) from None
        return self._json


class OffLoopJsonRoute(APIRoute):
    """An ``APIRoute`` whose handler reads its body through ``OffLoopJsonRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(OffLoopJsonRequest(request.scope, request.receive))

        return handle
