"""Finds KV-connector plugins through their entry points and builds the configured connector.

Like backends: each entry point is loaded inside its own try/except, so a broken plugin is
reported and never takes the process down; only the plugin that lists a connector is asked to
build it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

import pluggy

from platform_core.config import KVTransferConfig
from platform_core.errors import ConfigError, PlatformCoreError
from platform_core.kv_transfer import hookspecs
from platform_core.kv_transfer.interfaces import (
    KVConnectorInfo,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from platform_core.plugins.hookspecs import PROJECT_NAME, api_compatible, format_api_version

logger = logging.getLogger("platform_core.kv_transfer")


class KVConnectorRegistry:
    """The installed connectors, and how to build one side of the configured connector."""

    def __init__(self, eps: Iterable[EntryPoint] | None = None) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.broken: dict[str, str] = {}  # entry-point name -> why it could not be loaded
        group = hookspecs.KV_CONNECTOR_ENTRY_POINT_GROUP
        for ep in entry_points(group=group) if eps is None else eps:
            try:
                self._pm.register(ep.load(), name=ep.name)
            except Exception as exc:
                logger.warning("KV connector plugin %r failed to load: %r", ep.name, exc)
                self.broken[ep.name] = f"failed to import: {exc!r}"

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object directly (tests, embedded connectors)."""
        self._pm.register(plugin, name=name)

    def infos(self) -> list[tuple[KVConnectorInfo, str]]:
        """Every listed connector with the plugin listing it, by name."""
        found = []
        for impl in self._pm.hook.platform_core_kv_connector_info.get_hookimpls():
            try:
                rows = impl.function()
            except Exception as exc:
                self.broken[impl.plugin_name] = f"listing raised {exc!r}"
                continue
            found += [(row, impl.plugin_name) for row in rows]
        return sorted(found, key=lambda item: item[0].name)

    def _plugin_of(self, name: str) -> str:
        infos = self.infos()
        for info, plugin in infos:
            if info.name != name:
                continue
            if not api_compatible(info.api_version, hookspecs.KV_CONNECTOR_API_VERSION):
                raise ConfigError(
                    f"KV connector {name!r} ({info.package}) implements connector API "
                    f"{format_api_version(info.api_version)}; this platform-core provides "
                    f"{format_api_version(hookspecs.KV_CONNECTOR_API_VERSION)}: update the side "
                    "that is older"
                )
            return plugin
        names = [info.name for info, _ in infos] or "none"
        broken = f"; plugins that failed: {self.broken}" if self.broken else ""
        raise ConfigError(f"unknown KV connector {name!r}; installed: {names}{broken}")

    def create_scheduler(self, config: KVTransferConfig, block_size: int) -> KVConnectorScheduler:
        """The scheduler side of ``config.kv_connector``."""
        hook = self._pm.hook.platform_core_create_kv_connector_scheduler
        arguments = {"name": config.kv_connector, "config": config, "block_size": block_size}
        return self._create(hook, config.kv_connector, arguments, "scheduler")

    def create_worker(self, config: KVTransferConfig) -> KVConnectorWorker:
        """The worker side of ``config.kv_connector``."""
        hook = self._pm.hook.platform_core_create_kv_connector_worker
        arguments = {"name": config.kv_connector, "config": config}
        return self._create(hook, config.kv_connector, arguments, "worker")

    def _create(self, hook: pluggy.HookCaller, name: str, arguments: dict, side: str):
        plugin = self._plugin_of(name)
        built = None
        try:
            for impl in hook.get_hookimpls():
                if impl.plugin_name == plugin:
                    built = impl.function(*(arguments[arg] for arg in impl.argnames))
        except PlatformCoreError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"KV connector plugin {plugin!r} failed to create the {side} side of {name!r}: "
                f"{exc!r}"
            ) from exc
        if built is None:
            raise ConfigError(f"KV connector {name!r} is listed but its plugin built no {side}")
        return built
