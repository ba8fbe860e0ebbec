"""The connectors platform-core ships, registered through its own entry points like any plugin.

``tcp``: across hosts, the producer listens on ``kv_ip:kv_port`` and consumers pull over TCP.
``shm``: instances on one host; control over a local socket, blocks through shared memory.
``loopback``: instances in one process (an offline P/D pair, tests). ``faults``: any of them
with injected faults (``platform_core.kv_transfer.faults``), for tests and conformance runs.
"""

from __future__ import annotations

from typing import Any

from platform_core.config import KVTransferConfig
from platform_core.errors import ConfigError
from platform_core.kv_transfer.hookspecs import KV_CONNECTOR_API_VERSION
from platform_core.kv_transfer.interfaces import (
    KVConnectorInfo,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from platform_core.kv_transfer.transport import BlockTransport
from platform_core.plugins.hookspecs import hookimpl
from platform_core.plugins.identity import installed_version

PACKAGE = "platform-core"
DESCRIPTIONS = {
    "tcp": "producer listens on kv_ip:kv_port, consumers pull blocks over TCP (across hosts)",
    "shm": "one host: control over a local socket, blocks through shared memory",
    "loopback": "instances in one process (an offline pair, tests)",
    "faults": "another transport with injected faults (tests, conformance)",
}


def _transport(kind: str, config: KVTransferConfig) -> BlockTransport:
    extra = config.kv_connector_extra_config
    if kind == "tcp":
        from platform_core.kv_transfer.tcp_transport import TcpTransport

        return TcpTransport(config.kv_ip, config.kv_port, extra.get("advertise_host"))
    if kind == "shm":
        from platform_core.kv_transfer.shm_transport import ShmTransport

        return ShmTransport(config.kv_ip, config.kv_port)
    if kind == "loopback":
        from platform_core.kv_transfer.loopback_transport import LoopbackTransport

        return LoopbackTransport(config.engine_id or "")
    if kind == "faults":
        from platform_core.kv_transfer.faults import FaultPlan, FaultyTransport

        plan = FaultPlan.parse(extra)
        if plan.transport == "faults":
            raise ConfigError("the faults connector cannot wrap itself")
        return FaultyTransport(_transport(plan.transport, config), plan)
    raise ConfigError(f"unknown built-in KV transport {kind!r}")


def _address(kind: str, config: KVTransferConfig) -> dict[str, Any]:
    """Where consumers reach this producer, known before its transport starts."""
    if kind == "faults":
        from platform_core.kv_transfer.faults import FaultPlan

        return _address(FaultPlan.parse(config.kv_connector_extra_config).transport, config)
    if kind == "loopback":
        return {"engine_id": config.engine_id or ""}
    if config.is_producer and config.kv_port == 0:
        raise ConfigError(f"the {kind} connector's producer needs a fixed kv_port (not 0)")
    host = config.kv_connector_extra_config.get("advertise_host") or config.kv_ip
    return {"host": host, "port": config.kv_port}


@hookimpl
def platform_core_kv_connector_info() -> list[KVConnectorInfo]:
    version = installed_version(PACKAGE)
    return [
        KVConnectorInfo(name, PACKAGE, version, KV_CONNECTOR_API_VERSION, description)
        for name, description in DESCRIPTIONS.items()
    ]


@hookimpl
def platform_core_create_kv_connector_scheduler(
    name: str, config: KVTransferConfig, block_size: int
) -> KVConnectorScheduler | None:
    if name not in DESCRIPTIONS:
        return None
    from platform_core.kv_transfer.pull_scheduler import PullScheduler

    return PullScheduler(name, config, block_size, _address(name, config))


@hookimpl
def platform_core_create_kv_connector_worker(
    name: str, config: KVTransferConfig
) -> KVConnectorWorker | None:
    if name not in DESCRIPTIONS:
        return None
    from platform_core.kv_transfer.pull_worker import PullWorker

    return PullWorker(config, _transport(name, config))
