"""A transport between instances in one process (tests, an offline P/D pair): a function call.

Producers are found by ``engine_id`` in a process-wide table; a fetch copies the rows, as a real
transport would hand over a copy.
"""

from __future__ import annotations

import threading
from typing import Any

from platform_core.kv_transfer.interfaces import KVLayout
from platform_core.kv_transfer.transport import (
    BlockBatch,
    BlockSource,
    BlockTransport,
    TransferError,
)

_PRODUCERS: dict[str, BlockSource] = {}  # engine id -> its blocks (mutated under _LOCK)
_LOCK = threading.Lock()


class LoopbackTransport(BlockTransport):
    """Serves and fetches by engine id within this process."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._serving = False

    def serve(self, source: BlockSource) -> None:
        with _LOCK:
            if self.engine_id in _PRODUCERS:
                raise TransferError(f"engine id {self.engine_id!r} already serves KV blocks here")
            _PRODUCERS[self.engine_id] = source
        self._serving = True

    def address(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id}

    def _producer(self, address: dict[str, Any]) -> BlockSource:
        with _LOCK:
            source = _PRODUCERS.get(address.get("engine_id", ""))
        if source is None:
            raise TransferError(f"no producer {address.get('engine_id')!r} in this process")
        return source

    def fetch(
        self, address: dict[str, Any], transfer_id: str, positions: list[int], layout: KVLayout
    ) -> BlockBatch:
        source = self._producer(address)
        if not source.layout.compatible(layout):
            raise TransferError(
                f"the producer's blocks are {source.layout.block_shape}, this instance's "
                f"{layout.block_shape}"
            )
        batch = source.read(transfer_id, positions)
        return BlockBatch(batch.data.clone(), list(batch.checksums), list(batch.missing))

    def confirm(self, address: dict[str, Any], transfer_id: str) -> None:
        self._producer(address).confirm(transfer_id)

    def close(self) -> None:
        if self._serving:
            with _LOCK:
                _PRODUCERS.pop(self.engine_id, None)
            self._serving = False
