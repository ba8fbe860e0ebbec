"""ASGI middleware of the server: Host allow-list, API-key check and request body size limit.

All are plain ASGI (not ``BaseHTTPMiddleware``) so that streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from platform_core.entrypoints.openai.errors import error_body
from platform_core.entrypoints.openai.limits import ANY_HOST

# Paths reachable without the API key: load balancers probe /health (SageMaker: /ping),
# Prometheus scrapes /metrics (unless the server is told to guard it too).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    """Answer with an OpenAI error body straight from middleware."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def host_name(header: bytes) -> str:
    """The hostname of a ``Host`` header value, without its port (``[::1]:8000`` -> ``::1``)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    name, colon, port = text.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else text


class AllowedHostsMiddleware:
    """A request whose ``Host`` header is not in ``hosts`` gets 400 (``*`` allows any).

    A page from another origin that rebinds its DNS name to 127.0.0.1 still sends its own name
    in ``Host``, so this keeps such pages from driving a server that listens on loopback.
    """

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...]) -> None:
        self.app = app
        self.hosts = frozenset(h.strip("[]").lower() for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ANY_HOST not in self.hosts:
            header = dict(scope["headers"]).get(b"host")
            # HTTP/1.0 may omit Host; browsers (the rebinding threat) always send it.
            if header is not None and host_name(header) not in self.hosts:
                await send_error(
                    send,
                    400,
                    "the Host header names a host this server does not answer for "
                    "(see --allowed-hosts)",
                    "invalid_host",
                )
                return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Every path but ``open_paths`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # Constant-time comparison: the response time does not tell how much of a key matched.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            await send_error(send, 401, "a valid API key is required", "invalid_api_key")
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole request body up front and answers 413 when it is over ``max_bytes``.

    The app then reads the buffered body; later ``receive`` calls go to the server, so
    disconnect detection still works.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        buffered: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal buffered
            if buffered is None:
                return await receive()
            message, buffered = buffered, None
            return message

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send, 413, f"the request body is larger than {self.max_bytes} bytes", "body_too_large"
        )


class RootPathMiddleware:
    """Serves the app under ``root_path``, the prefix a reverse proxy adds (``--root-path``).

    Routing strips the prefix when the path has it, so a proxy may keep or strip it; links the
    app makes (``/openapi.json``'s server URL) carry it. FastAPI's own ``root_path`` argument
    did this but is deprecated.
    """

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)
