"""The upstream instances of each side and the policy that picks a healthy one per request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from platform_core.entrypoints.openai.errors import error_response


@dataclass(eq=False)
class Upstream:
    """One instance: its base URL, the proxy's own count of its requests in flight, and its
    health as last found (``detail``: how, or why not; ``failed_polls``: health polls failed
    in a row; ``marked_down_at``: when it last left the rotation, monotonic seconds)."""

    url: str
    in_flight: int = 0
    healthy: bool = True
    detail: str = "not checked yet"
    failed_polls: int = 0
    marked_down_at: float = float("-inf")


class NoHealthyUpstream(Exception):
    """No instance of ``side`` is healthy."""

    def __init__(self, side: str) -> None:
        super().__init__(f"no {side} instance is healthy")
        self.side = side

    def response(self) -> JSONResponse:
        """The client's answer: 503 with an OpenAI error body naming the side."""
        return error_response(503, str(self), code=f"no_healthy_{self.side}")


class UpstreamPool:
    """The instances of one side (``prefill`` or ``decode``).

    ``acquire`` picks a healthy one by ``policy`` and counts the request in flight there until
    ``release``: ``round-robin`` takes each in turn; ``least-loaded`` the one with the fewest
    requests in flight, ties broken in turn. With none healthy it raises ``NoHealthyUpstream``.
    """

    def __init__(self, side: str, urls: Sequence[str], policy: str) -> None:
        self.side = side
        self.upstreams = [Upstream(url) for url in urls]
        self.policy = policy
        self._turn = itertools.count()

    def healthy(self) -> list[Upstream]:
        """The instances in rotation."""
        return [upstream for upstream in self.upstreams if upstream.healthy]

    def acquire(self) -> Upstream:
        healthy = self.healthy()
        if not healthy:
            raise NoHealthyUpstream(self.side)
        start = next(self._turn) % len(healthy)
        in_turn = healthy[start:] + healthy[:start]
        if self.policy == "least-loaded":
            chosen = min(in_turn, key=lambda upstream: upstream.in_flight)  # the first of ties
        else:
            chosen = in_turn[0]
        chosen.in_flight += 1
        return chosen

    def release(self, upstream: Upstream) -> None:
        upstream.in_flight -= 1
