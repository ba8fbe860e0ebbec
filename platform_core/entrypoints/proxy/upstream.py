"""Requests to upstream instances: the headers passed on, and failures (unreachable, 5xx) as
``UpstreamError``, answered 502 naming the side that failed (``NotConnected`` when the request
never reached the instance)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from platform_core.entrypoints.openai.errors import error_response
from platform_core.entrypoints.proxy.routing import Upstream

# Request headers passed on to upstreams: the client's credentials and its request id.
FORWARDED_HEADERS = ("authorization", "x-request-id")
# How much of a failing upstream's answer its 502 quotes.
_DETAIL_CHARS = 300


class UpstreamError(Exception):
    """An upstream instance of ``side`` (``prefill`` or ``decode``) could not be reached or
    failed; ``reason`` says how."""

    def __init__(self, side: str, url: str, reason: str) -> None:
        super().__init__(f"the {side} instance {url} {reason}")
        self.side = side
        self.url = url

    def response(self) -> JSONResponse:
        """The client's answer: 502 with an OpenAI error body naming the side."""
        return error_response(502, str(self), code=f"{self.side}_unavailable")


class NotConnected(UpstreamError):
    """The instance could not be connected to (``detail``: the failure): it never got the
    request, which may go to another instance."""

    def __init__(self, side: str, url: str, detail: str) -> None:
        super().__init__(side, url, f"is unreachable ({detail})")
        self.detail = detail


def forwarded_headers(request: Request) -> dict[str, str]:
    """The headers of ``request`` that its upstream requests carry too."""
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def describe(exc: Exception) -> str:
    """An httpx failure in a few words (some have an empty message)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def call(
    client: httpx.AsyncClient,
    side: str,
    upstream: Upstream,
    method: str,
    path: str,
    headers: dict[str, str],
    body: dict[str, Any] | None = None,
    stream: bool = False,
) -> httpx.Response:
    """``method path`` on ``upstream``: its answer below 500, read in full unless ``stream``
    (then the caller closes it). Raises ``UpstreamError`` when it cannot be reached or
    answers 5xx (``NotConnected`` when it cannot be connected to)."""
    content = None
    if body is not None:
        # ASCII JSON: a lone surrogate a client sent escaped travels escaped, as it came.
        content = json.dumps(body).encode()
        headers = {**headers, "content-type": "application/json"}
    request = client.build_request(method, upstream.url + path, content=content, headers=headers)
    try:
        response = await client.send(request, stream=stream)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise NotConnected(side, upstream.url, describe(exc)) from exc
    except httpx.HTTPError as exc:  # after the request went out: the instance may have run it
        raise UpstreamError(side, upstream.url, f"failed mid-request ({describe(exc)})") from exc
    if response.status_code >= 500:
        try:
            detail = (await response.aread()).decode(errors="replace")[:_DETAIL_CHARS]
        except httpx.HTTPError as exc:
            detail = describe(exc)
        finally:
            await response.aclose()
        reason = f"answered {response.status_code}: {detail}"
        raise UpstreamError(side, upstream.url, reason)
    return response
