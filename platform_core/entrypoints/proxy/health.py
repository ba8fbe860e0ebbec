"""Which instances are healthy: each one's ``/health`` polled in the background (``HealthChecker``),
state changes logged once, and the proxy's own ``/health`` report read from that state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from platform_core.entrypoints.proxy.routing import Upstream, UpstreamPool
from platform_core.entrypoints.proxy.upstream import describe

logger = logging.getLogger("platform_core.proxy")


# Health polls that must fail in a row (a timeout or a status other than 200) before an
# instance leaves the rotation: one slow answer under load is not a down instance. Refused
# connections take it out at once.
FAILED_POLLS_TO_EVICT = 2


def record_health(side: str, upstream: Upstream, healthy: bool, detail: str) -> None:
    """Set ``upstream``'s health (``detail``: how, or why not); log when it changes."""
    upstream.detail = detail
    if not healthy:
        upstream.marked_down_at = time.monotonic()
    if healthy == upstream.healthy:
        return
    upstream.healthy = healthy
    if healthy:
        logger.info("the %s instance %s is healthy again (%s)", side, upstream.url, detail)
    else:
        logger.warning("the %s instance %s became unhealthy: %s", side, upstream.url, detail)


class HealthChecker:
    """Asks every instance's ``/health`` every ``interval`` seconds, each answer within
    ``timeout``: 200 is healthy; a refused connection is down at once, and a timeout, any
    other status or failure is down after ``FAILED_POLLS_TO_EVICT`` polls in a row. An answer
    to a poll sent before the instance was last marked down (by a request that could not
    connect) is not taken as healthy."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pools: Sequence[UpstreamPool],
        interval: float,
        timeout: float,
    ) -> None:
        self.client = client
        self.pools = pools
        self.interval = interval
        self.timeout = timeout

    async def check(self) -> None:
        """Ask every instance once and record the answers."""
        checks = [self._check(pool.side, u) for pool in self.pools for u in pool.upstreams]
        await asyncio.gather(*checks)

    async def run(self) -> None:
        """``check`` every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    async def _check(self, side: str, upstream: Upstream) -> None:
        sent = time.monotonic()
        try:
            response = await self.client.get(upstream.url + "/health", timeout=self.timeout)
        except httpx.ConnectError as exc:  # nothing listens there: out now
            record_health(side, upstream, False, describe(exc))
            return
        except Exception as exc:  # whatever went wrong, the poller keeps polling
            self._failed(side, upstream, describe(exc))
            return
        if response.status_code != 200:
            self._failed(side, upstream, f"HTTP {response.status_code}")
        elif upstream.marked_down_at < sent:
            upstream.failed_polls = 0
            record_health(side, upstream, True, "HTTP 200")

    @staticmethod
    def _failed(side: str, upstream: Upstream, detail: str) -> None:
        upstream.failed_polls += 1
        if upstream.failed_polls >= FAILED_POLLS_TO_EVICT:
            record_health(side, upstream, False, detail)
        else:
            upstream.detail = detail


def health_report(pools: Sequence[UpstreamPool]) -> tuple[bool, dict[str, Any]]:
    """Whether every side has a healthy instance, and the report: ``status`` (``ok`` or
    ``unavailable``) and each side's instances (``url``, ``healthy``, ``detail``)."""
    healthy = all(pool.healthy() for pool in pools)
    report: dict[str, Any] = {"status": "ok" if healthy else "unavailable"}
    for pool in pools:
        report[pool.side] = [
            {"url": u.url, "healthy": u.healthy, "detail": u.detail} for u in pool.upstreams
        ]
    return healthy, report
