"""Discovers backend plugins through entry points, probes them, and chooses one.

Each entry point is loaded and each hook called inside its own try/except: a broken plugin shows
up as an unavailable row with its error and never takes the process down.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import pluggy

from platform_core.config import EngineConfig
from platform_core.errors import BackendError
from platform_core.plugins import hookspecs
from platform_core.plugins.interfaces import Backend, BackendInfo

logger = logging.getLogger("platform_core.plugins")


class PluginManager:
    """Loads backend plugins and answers "which backends exist and which one runs"."""

    def __init__(self, eps: Iterable[EntryPoint] | None = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._broken: list[BackendInfo] = []
        for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP) if eps is None else eps:
            self._load(ep)

    def register(self, plugin: ModuleType | object, name: str | None = None) -> None:
        """Register a plugin object directly (tests, embedded backends)."""
        self._pm.register(plugin, name=name)

    def _load(self, ep: EntryPoint) -> None:
        try:
            self._pm.register(ep.load(), name=ep.name)
        except Exception as exc:
            logger.warning("backend plugin %r failed to load: %r", ep.name, exc)
            self._broken.append(_broken_info(ep, f"failed to import: {exc!r}"))

    def probe(self) -> list[BackendInfo]:
        """One row per backend, usable or not, highest priority first."""
        rows = list(self._broken)
        for impl in self._pm.hook.platform_core_backend_info.get_hookimpls():
            try:
                info = impl.function()
            except Exception as exc:
                rows.append(_broken_info(None, f"probe raised {exc!r}", impl.plugin_name))
                continue
            if not hookspecs.api_compatible(info.api_version):
                info = _incompatible(info)
            rows.append(info)
        return sorted(rows, key=lambda r: (not r.available, -r.priority, r.name))

    def choose(self, requested: str = "auto") -> BackendInfo:
        """The backend to run: ``requested`` by name, or the best available for ``"auto"``."""
        rows = self.probe()
        available = [r for r in rows if r.available]
        if requested == "auto":
            if not available:
                raise BackendError(
                    "no backend is available; install one (e.g. pip install platform-core[cpu]). "
                    f"Probed: {_summary(rows)}"
                )
            return available[0]
        for row in rows:
            if row.name == requested:
                if row.available:
                    return row
                raise BackendError(
                    f"backend {requested!r} is not available: {row.reason}. "
                    f"Available backends: {[r.name for r in available] or 'none'}"
                )
        raise BackendError(
            f"unknown backend {requested!r}; installed: {[r.name for r in rows] or 'none'}, "
            f"available: {[r.name for r in available] or 'none'}"
        )

    def create(self, config: EngineConfig) -> Backend:
        """Choose and build the backend for ``config.backend``."""
        info = self.choose(config.backend)
        backend = self._pm.hook.platform_core_create_backend(name=info.name, config=config)
        if backend is None:
            raise BackendError(f"backend {info.name!r} probed available but created nothing")
        return backend


def _broken_info(ep: EntryPoint | None, reason: str, name: str | None = None) -> BackendInfo:
    package = ep.dist.name if ep is not None and ep.dist is not None else "?"
    version = ep.dist.version if ep is not None and ep.dist is not None else "?"
    return BackendInfo(
        name=name or (ep.name if ep else "?"),
        package=package,
        version=version,
        api_version=(0, 0),
        available=False,
        reason=reason,
        priority=0,
        device="?",
    )


def _incompatible(info: BackendInfo) -> BackendInfo:
    """The row of a plugin whose API this core cannot run, saying which side to update."""
    declared = ".".join(map(str, info.api_version))
    core = hookspecs.PLUGIN_API_VERSION
    provided = ".".join(map(str, core))
    if info.api_version[0] != core[0]:
        reason = (
            f"the plugin targets an incompatible major plugin API {declared} (this "
            f"platform-core provides {provided}): rebuild the plugin for plugin API {core[0]}.x"
        )
    else:
        reason = (
            f"the plugin needs plugin API {declared}, newer than this platform-core provides "
            f"({provided}): upgrade platform-core"
        )
    return dataclasses.replace(info, available=False, reason=reason)


def _summary(rows: list[BackendInfo]) -> str:
    return "; ".join(f"{r.name}: {r.reason}" for r in rows) or "no backend plugins installed"
