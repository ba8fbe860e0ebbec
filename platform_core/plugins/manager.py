"""Discovers backend plugins through entry points, probes them, and chooses one.

Each entry point is loaded and each probe called inside its own try/except: a broken plugin shows
up as an unavailable row with its error and never takes the process down. Only the chosen
backend's plugin is asked to create it, so another plugin's broken create hook cannot abort the
start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import pluggy

from platform_core.config import EngineConfig
from platform_core.errors import BackendError, PlatformCoreError
from platform_core.plugins import hookspecs
from platform_core.plugins.interfaces import Backend, BackendInfo

logger = logging.getLogger("platform_core.plugins")


class PluginManager:
    """Loads backend plugins and answers "which backends exist and which one runs"."""

    def __init__(self, eps: Iterable[EntryPoint] | None = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._broken: list[tuple[BackendInfo, str]] = []
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
            self._broken.append((_broken_info(ep, f"failed to import: {exc!r}"), ep.name))

    def probe(self) -> list[BackendInfo]:
        """One row per backend, usable or not, highest priority first."""
        return [row for row, _ in self._rows()]

    def _rows(self) -> list[tuple[BackendInfo, str]]:
        """The probe rows, each with the name of the plugin it is about."""
        rows = list(self._broken)
        for impl in self._pm.hook.platform_core_backend_info.get_hookimpls():
            try:
                info = impl.function()
            except Exception as exc:
                row = _broken_info(None, f"probe raised {exc!r}", impl.plugin_name)
                rows.append((row, impl.plugin_name))
                continue
            if not hookspecs.api_compatible(info.api_version):
                info = _incompatible(info)
            rows.append((info, impl.plugin_name))
        return sorted(rows, key=lambda r: (not r[0].available, -r[0].priority, r[0].name))

    def choose(self, requested: str = "auto") -> BackendInfo:
        """The backend to run: ``requested`` by name, or the best available for ``"auto"``."""
        return self._choose(requested)[0]

    def _choose(self, requested: str) -> tuple[BackendInfo, str]:
        rows = self._rows()
        available = [(r, plugin) for r, plugin in rows if r.available]
        if requested == "auto":
            if not available:
                raise BackendError(
                    "no backend is available; install one (e.g. pip install platform-core[cpu]). "
                    f"Probed: {_summary([r for r, _ in rows])}"
                )
            return available[0]
        names = [r.name for r, _ in available] or "none"
        for row, plugin in rows:
            if row.name == requested:
                if row.available:
                    return row, plugin
                raise BackendError(
                    f"backend {requested!r} is not available: {row.reason}. "
                    f"Available backends: {names}"
                )
        raise BackendError(
            f"unknown backend {requested!r}; installed: {[r.name for r, _ in rows] or 'none'}, "
            f"available: {names}"
        )

    def create(self, config: EngineConfig) -> Backend:
        """Choose the backend for ``config.backend`` and build it through the create hook of
        the plugin that reported it, and of no other plugin."""
        info, plugin_name = self._choose(config.backend)
        arguments = {"name": info.name, "config": config}
        backend = None
        try:
            for impl in self._pm.hook.platform_core_create_backend.get_hookimpls():
                if impl.plugin_name == plugin_name:
                    backend = impl.function(*(arguments[arg] for arg in impl.argnames))
        except PlatformCoreError:
            raise
        except Exception as exc:
            logger.warning("backend plugin %r failed to create %r: %r", plugin_name, info.name, exc)
            raise BackendError(
                f"backend plugin {plugin_name!r} failed to create backend {info.name!r}: {exc!r}"
            ) from exc
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
    declared = hookspecs.format_api_version(info.api_version)
    core = hookspecs.PLUGIN_API_VERSION
    provided = hookspecs.format_api_version(core)
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
