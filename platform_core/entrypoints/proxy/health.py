"""Which instances are healthy: each one's ``/health`` polled in the background (``HealthChecker``),
state changes logged once, and the proxy's own ``/health`` report read from that state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from platform_core.entrypoints.proxy.routing import Upstream, UpstreamPool
from platform_core.entrypoints.proxy.upstream import describe

logger = logging.getLogger("platform_core.proxy")


def record_health(side: str, upstream: Upstream, healthy: bool, detail: str) -> None:
    """Set ``upstream``'s health (``detail``: how, or why not); log when it changes."""
    upstream.detail = detail
    if healthy == upstream.healthy:
        return
    upstream.healthy = healthy
    if healthy:
        logger.info("the %s instance %s is healthy again (%s)", side, upstream.url, detail)
    else:
        logger.warning("the %s instance %s became unhealthy: %s", side, upstream.url, detail)


class HealthChecker:
    """Asks every instance's ``/health`` every ``interval`` seconds, each answer within
    ``timeout``: 200 is healthy; any other status, a timeout or no connection is not."""

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
        try:
            response = await self.client.get(upstream.url + "/health", timeout=self.timeout)
        except httpx.HTTPError as exc:
            record_health(side, upstream, False, describe(exc))
            return
        healthy = response.status_code == 200
        record_health(side, upstream, healthy, f"HTTP {response.status_code}")


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
