"""The KV-connector API: every name a connector package (or the conformance suite) imports from
the core.

A connector distribution registers a module under the entry-point group
``platform_core.kv_connectors`` and implements the hooks of
:mod:`platform_core.kv_transfer.hookspecs` with ``hookimpl``, returning the two sides of its
connector (``KVConnectorScheduler``, ``KVConnectorWorker``). A vendor whose fabric only moves
bytes need not write either side: ``PullScheduler`` and ``PullWorker`` (the built-in connectors'
logic: holds, pulls, checksums, recompute on failure) run over any ``BlockTransport``, so the
package implements ``serve``/``address``/``fetch``/``confirm`` and nothing else.
"""

from __future__ import annotations

from platform_core.config import KVTransferConfig
from platform_core.errors import ConfigError, PlatformCoreError
from platform_core.kv_transfer.cache_access import BackendKVCache, kv_layout
from platform_core.kv_transfer.hookspecs import (
    KV_CONNECTOR_API_VERSION,
    KV_CONNECTOR_ENTRY_POINT_GROUP,
)
from platform_core.kv_transfer.interfaces import (
    ConnectorRequest,
    FinishedRequestKV,
    KVCacheAccess,
    KVConnectorInfo,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLayout,
    RemoteTokens,
    TransferStats,
)
from platform_core.kv_transfer.pull_scheduler import PullScheduler
from platform_core.kv_transfer.pull_worker import PullWorker, crc32_rows
from platform_core.kv_transfer.registry import KVConnectorRegistry
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockSource,
    BlockTransport,
    TransferError,
    UnknownTransferError,
)
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.identity import installed_version

__all__ = [  # noqa: RUF022 - grouped by topic, not sorted
    # the plugin contract
    "KV_CONNECTOR_API_VERSION",
    "KV_CONNECTOR_ENTRY_POINT_GROUP",
    "hookimpl",
    "installed_version",
    "KVConnectorRegistry",
    "KVConnectorInfo",
    "KVTransferConfig",
    # the two sides and what passes between them and the core
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "ConnectorRequest",
    "RemoteTokens",
    "FinishedRequestKV",
    "KVConnectorOutput",
    "TransferStats",
    "KVCacheAccess",
    "KVLayout",
    "BackendKVCache",
    "kv_layout",
    # building a connector from a transport
    "PullScheduler",
    "PullWorker",
    "BlockTransport",
    "BlockSource",
    "BlockBatch",
    "crc32_rows",
    # errors
    "PlatformCoreError",
    "ConfigError",
    "TransferError",
    "UnknownTransferError",
]
