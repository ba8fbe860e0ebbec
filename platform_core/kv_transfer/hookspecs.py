"""The KV-connector plugin contract: hooks, entry-point group and version.

A connector distribution registers a module under the entry-point group
``platform_core.kv_connectors``; the module implements the hooks below with ``@hookimpl``
(the same marker as backends', from ``platform_core.backend_api``). Hooks return objects, never
import strings. The built-in connectors (``tcp``, ``shm``, ``faults``, ``loopback``) are
registered by platform-core's own distribution the same way.

Versioning follows the backend plugin API's rules (``platform_core.plugins.hookspecs``): a minor
only adds; a connector declaring another major, or a newer minor, is refused with the side to
update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from platform_core.plugins.hookspecs import hookspec

if TYPE_CHECKING:
    from platform_core.config import KVTransferConfig
    from platform_core.kv_transfer.interfaces import (
        KVConnectorInfo,
        KVConnectorScheduler,
        KVConnectorWorker,
    )

KV_CONNECTOR_ENTRY_POINT_GROUP = "platform_core.kv_connectors"
KV_CONNECTOR_API_VERSION = (1, 0)


@hookspec
def platform_core_kv_connector_info() -> list[KVConnectorInfo]:
    """The connectors this plugin provides (cheap and side-effect free: no sockets, no
    threads)."""


@hookspec(firstresult=True)
def platform_core_create_kv_connector_scheduler(
    name: str, config: KVTransferConfig, block_size: int
) -> KVConnectorScheduler | None:
    """The scheduler side of connector ``name`` (``None`` when ``name`` is not this plugin's),
    for an engine whose KV blocks hold ``block_size`` tokens. Raise ``ConfigError`` for a
    setting the connector cannot take."""


@hookspec(firstresult=True)
def platform_core_create_kv_connector_worker(
    name: str, config: KVTransferConfig
) -> KVConnectorWorker | None:
    """The worker side of connector ``name`` (``None`` when ``name`` is not this plugin's).
    It may open sockets and start threads only in ``register_kv_caches``."""
