"""What ``platform-core proxy`` is given: its upstream instances, routing policy and timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from platform_core.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from platform_core.errors import ConfigError

ROUTING_POLICIES = ("round-robin", "least-loaded")
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_HEALTH_INTERVAL = 5.0
DEFAULT_HEALTH_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """The proxy's settings.

    ``prefill`` / ``decode``: base URLs of the instances (``http://host:port``, without ``/v1``).
    ``routing``: how one instance of a side is picked per request (``ROUTING_POLICIES``).
    ``api_key``: the key the proxy itself requires (``Authorization: Bearer``) on every route
    but ``/health`` and ``/metrics``. ``connect_timeout``: seconds to connect to an upstream
    before it counts as down (and out of rotation); every ``health_interval`` seconds each
    upstream's ``/health`` is asked, and may take ``health_timeout`` seconds to answer 200
    before it counts as unhealthy. ``max_body_bytes``: larger request bodies get 413.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    routing: str = ROUTING_POLICIES[0]
    api_key: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    health_interval: float = DEFAULT_HEALTH_INTERVAL
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for side in ("prefill", "decode"):
            urls = getattr(self, side)
            if not urls:
                raise ConfigError(f"give at least one {side} instance URL")
            object.__setattr__(self, side, tuple(_base_url(url, side) for url in urls))
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty; give a non-empty key, or none for no auth")
        if min(self.connect_timeout, self.health_interval, self.health_timeout) <= 0:
            raise ConfigError("timeouts and the health interval must be > 0 seconds")


def _base_url(url: str, side: str) -> str:
    """``url`` without a trailing ``/``, refused unless an http(s) URL with a host (and a
    numeric port, if it has one)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{side} instance {url!r} is not an http:// or https:// URL")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise ConfigError(f"{side} instance {url!r} has a bad port: {exc}") from exc
    if not parts.hostname:
        raise ConfigError(f"{side} instance {url!r} has no host")
    return url.rstrip("/")
