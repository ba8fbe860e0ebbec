"""The proxy's ``/health``: each upstream's own ``/health``, asked with a short timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from platform_core.entrypoints.proxy.routing import UpstreamPool
from platform_core.entrypoints.proxy.upstream import describe


@dataclass(frozen=True, slots=True)
class UpstreamHealth:
    """One instance's answer to ``/health``: ``detail`` is its status or why it gave none."""

    url: str
    healthy: bool
    detail: str


async def _check(client: httpx.AsyncClient, url: str, timeout: float) -> UpstreamHealth:
    try:
        response = await client.get(url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return UpstreamHealth(url, False, describe(exc))
    return UpstreamHealth(url, response.status_code == 200, f"HTTP {response.status_code}")


async def health_report(
    client: httpx.AsyncClient, pools: Sequence[UpstreamPool], timeout: float
) -> tuple[bool, dict[str, Any]]:
    """Whether every side has a healthy instance, and the report: ``status`` (``ok`` or
    ``unavailable``) and each side's instances (``url``, ``healthy``, ``detail``)."""
    checks = [
        asyncio.gather(*(_check(client, u.url, timeout) for u in pool.upstreams)) for pool in pools
    ]
    sides = dict(zip((pool.side for pool in pools), await asyncio.gather(*checks)))
    healthy = all(any(check.healthy for check in found) for found in sides.values())
    report: dict[str, Any] = {"status": "ok" if healthy else "unavailable"}
    report.update({side: [asdict(check) for check in found] for side, found in sides.items()})
    return healthy, report
