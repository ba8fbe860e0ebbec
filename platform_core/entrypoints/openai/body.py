"""Request bodies decoded as JSON, with an error that says what is wrong when they are not UTF-8.

Decoding stays on the event loop, bounded by ``--max-body-bytes`` (default 4 MiB: half a million
token ids decode in about 40 ms, during which ``/health`` waits). Decoding large bodies on a worker
thread with the pure-Python decoder (which yields the GIL) kept ``/health`` at 33 ms for a
million ids, but the seconds of Python it ran fought the engine thread for the GIL: a steady
client's TPOT p99 went from 10 to 64 ms beside the soak's hostile load. One short pause beats
a long convoy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response


class JsonBodyRequest(Request):
    """A request whose body, if not UTF-8, fails as a JSON error (a 400 naming the offset)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body)
            except UnicodeDecodeError as exc:  # FastAPI answers JSON errors as 400s naming them
                raise json.JSONDecodeError(f"invalid UTF-8 ({exc.reason})", "", exc.start) from None
        return self._json


class JsonBodyRoute(APIRoute):
    """An ``APIRoute`` whose handler reads its body through ``JsonBodyRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return handle
