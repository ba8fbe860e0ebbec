"""Who a backend is: the fixed part of its probe rows, and installed distribution versions.

Both are cheap (no torch, no import of the distribution), as a probe must be.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from platform_core.plugins.interfaces import BackendInfo, Capabilities


def installed_version(*distributions: str, missing: str = "unknown") -> str:
    """The version of the first of ``distributions`` that is installed, else ``missing``."""
    for distribution in distributions:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return missing


@dataclass(frozen=True, slots=True)
class BackendIdentity:
    """What every probe row of one backend shares: its name, distribution, the plugin API it
    implements and its priority."""

    name: str
    package: str
    api_version: tuple[int, int]
    priority: int

    def row(
        self,
        version: str,
        capabilities: Capabilities | None,
        device: str,
        problem: str | None,
        ready: str,
        warning: str | None = None,
        details: tuple[str, ...] = (),
    ) -> BackendInfo:
        """The row: unavailable with ``problem`` as the reason when there is one, else
        available because ``ready``, with ``warning`` (something the probe noticed) appended."""
        return BackendInfo(
            name=self.name,
            package=self.package,
            version=version,
            api_version=self.api_version,
            available=problem is None,
            reason=problem or ready + (f" (warning: {warning})" if warning else ""),
            priority=self.priority,
            device=device,
            capabilities=capabilities,
            details=details,
        )
