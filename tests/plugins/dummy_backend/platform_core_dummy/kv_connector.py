"""A third-party KV connector, shipped the way a vendor would: a transport of its own under the
core's ``PullScheduler``/``PullWorker``, registered through the ``platform_core.kv_connectors``
entry point. Its "fabric" is a table in this process through which every batch passes as bytes."""

from __future__ import annotations

import threading
from typing import Any

import torch

from platform_core.kv_connector_api import (
    KV_CONNECTOR_API_VERSION,
    BlockBatch,
    BlockSource,
    BlockTransport,
    KVConnectorInfo,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLayout,
    KVTransferConfig,
    PullScheduler,
    PullWorker,
    TransferError,
    hookimpl,
    installed_version,
)

NAME = "dummy-pipe"
_FABRIC: dict[str, BlockSource] = {}
_FABRIC_LOCK = threading.Lock()


class PipeTransport(BlockTransport):
    """Batches cross as raw bytes plus a header, as over a wire."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id

    def serve(self, source: BlockSource) -> None:
        with _FABRIC_LOCK:
            _FABRIC[self.engine_id] = source

    def address(self) -> dict[str, Any]:
        return {"pipe": self.engine_id}

    def fetch(
        self, address: dict[str, Any], transfer_id: str, positions: list[int], layout: KVLayout
    ) -> BlockBatch:
        with _FABRIC_LOCK:
            source = _FABRIC.get(address["pipe"])
        if source is None:
            raise TransferError(f"no pipe {address['pipe']!r}")
        batch = source.read(transfer_id, positions)
        wire = batch.data.contiguous().view(torch.uint8).numpy().tobytes()
        data = torch.frombuffer(bytearray(wire), dtype=batch.data.dtype).view(batch.data.shape)
        return BlockBatch(data, list(batch.checksums), list(batch.missing))

    def confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        with _FABRIC_LOCK:
            source = _FABRIC.get(address["pipe"])
        if source is not None:
            source.confirm(transfer_id)

    def close(self) -> None:
        with _FABRIC_LOCK:
            _FABRIC.pop(self.engine_id, None)


@hookimpl
def platform_core_kv_connector_info() -> list[KVConnectorInfo]:
    version = installed_version("platform-core-dummy-backend")
    return [
        KVConnectorInfo(
            NAME, "platform-core-dummy-backend", version, KV_CONNECTOR_API_VERSION, "test pipe"
        )
    ]


@hookimpl
def platform_core_create_kv_connector_scheduler(
    name: str, config: KVTransferConfig, block_size: int
) -> KVConnectorScheduler | None:
    if name != NAME:
        return None
    return PullScheduler(name, config, block_size, {"pipe": config.engine_id})


@hookimpl
def platform_core_create_kv_connector_worker(
    name: str, config: KVTransferConfig
) -> KVConnectorWorker | None:
    return PullWorker(config, PipeTransport(config.engine_id)) if name == NAME else None
