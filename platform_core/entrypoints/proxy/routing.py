"""The upstream instances of each side and the policy that picks one per request."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(eq=False)
class Upstream:
    """One instance: its base URL and the proxy's own count of its requests in flight."""

    url: str
    in_flight: int = 0


class UpstreamPool:
    """The instances of one side (``prefill`` or ``decode``).

    ``acquire`` picks one by ``policy`` and counts the request in flight there until
    ``release``: ``round-robin`` takes each in turn; ``least-loaded`` the one with the fewest
    requests in flight, ties broken in turn.
    """

    def __init__(self, side: str, urls: Sequence[str], policy: str) -> None:
        self.side = side
        self.upstreams = [Upstream(url) for url in urls]
        self.policy = policy
        self._turn = itertools.count()

    def acquire(self) -> Upstream:
        start = next(self._turn) % len(self.upstreams)
        in_turn = self.upstreams[start:] + self.upstreams[:start]
        if self.policy == "least-loaded":
            chosen = min(in_turn, key=lambda upstream: upstream.in_flight)  # the first of ties
        else:
            chosen = in_turn[0]
        chosen.in_flight += 1
        return chosen

    def release(self, upstream: Upstream) -> None:
        upstream.in_flight -= 1

    @contextmanager
    def lease(self) -> Iterator[Upstream]:
        """An instance for the duration of the ``with`` block."""
        upstream = self.acquire()
        try:
            yield upstream
        finally:
            self.release(upstream)
